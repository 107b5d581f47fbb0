package usage

import (
	"net/http"
	"strconv"
	"strings"
)

// API is the request shape whose output cap is read and rewritten.
type API uint8

// The request shapes. The zero API is unknown: ReadBound reads no cap from it, and
// SetOutputCap sets none.
const (
	ChatCompletions   API = iota + 1 // OpenAI Chat Completions: max_completion_tokens, max_tokens, n
	Completions                      // OpenAI legacy Completions: max_tokens, n, best_of
	Responses                        // OpenAI Responses: max_output_tokens
	AnthropicMessages                // Anthropic Messages: max_tokens
	GeminiGenerate                   // Gemini generateContent and streamGenerateContent: generationConfig.maxOutputTokens, candidateCount
	Embeddings                       // embeddings: no output
)

// APIOf returns the API of a request whose URL path is path, read from the path's end:
// ".../chat/completions" is ChatCompletions, any other ".../completions" Completions,
// ".../responses" Responses, ".../messages" AnthropicMessages, ".../embeddings" Embeddings,
// ".../models/<model>:generateContent" and ".../models/<model>:streamGenerateContent" (or
// tunedModels) GeminiGenerate. Anything else, a trailing "/" included, is 0 (unknown). The
// path is matched as given, case and all: pass r.URL.Path.
func APIOf(path string) API {
	dir, last := "", path
	if i := strings.LastIndexByte(path, '/'); i >= 0 {
		dir, last = path[:i], path[i+1:]
	}
	switch last {
	case "completions":
		if dir == "chat" || strings.HasSuffix(dir, "/chat") {
			return ChatCompletions
		}
		return Completions
	case "responses":
		return Responses
	case "messages":
		return AnthropicMessages
	case "embeddings":
		return Embeddings
	}
	model, ok := strings.CutSuffix(last, ":generateContent")
	if !ok {
		model, ok = strings.CutSuffix(last, ":streamGenerateContent")
	}
	parent := dir[strings.LastIndexByte(dir, '/')+1:]
	if ok && model != "" && (parent == "models" || parent == "tunedModels") {
		return GeminiGenerate
	}
	return 0
}

// MaxChoices bounds the outputs a request may ask for and stay bounded (Bound.Choices).
const MaxChoices = 128

// Bound is what a request asks for, read from its body.
type Bound struct {
	// Readable is false when the body is not read: compressed, over MaxRequestBody, not one
	// JSON object with nothing after it, or its reading failed. Refusal then says why (415,
	// 413, 400) and the other fields are zero.
	Readable bool
	// Refusal, when its Status is not 0, is why the request cannot be bounded and is to be
	// refused: its body is not read (Readable false), or (400) a choices count is not a whole
	// number as every lax reader reads it, or is above MaxChoices. It names the member.
	Refusal Refusal
	// Unbounded is true when the prompt's tokens are not bounded by the body's bytes: a member
	// or "type" that unboundedKeys or unboundedTypes lists where the body holds content
	// (non-text content, context held by the upstream, server-side tools; not inside the
	// schemas and metadata schemaKeys names), a Responses "prompt" object, or a Gemini
	// generationConfig that is neither an object nor null. The output is still bounded by Cap
	// times Choices once SetOutputCap has written the cap.
	Unbounded bool
	// Prompt bounds the prompt in tokens: the body's length in bytes, plus AnthropicToolPrompt
	// for an AnthropicMessages request with tools. A text token covers at least one byte, and
	// the JSON around each message covers its chat template's tokens.
	Prompt int64
	// Cap is the output cap in tokens the request asks for, per choice, as the upstream reads
	// it: the last of a name given twice. With several cap members (ChatCompletions'
	// max_completion_tokens, max_tokens and n_predict) it is the largest. It is 0 when no cap is given, or
	// when one is not a positive integer (a string, 0, a negative or fractional number, 1e2,
	// a bool, null), or when a cap's name is given in another spelling that a reader may take
	// for it ("Max_Tokens", which Go's encoding/json reads as max_tokens). SetOutputCap
	// makes every cap member agree: call it with the cap reserved for, even when that is Cap.
	Cap int64
	// Choices is how many outputs the request generates: ChatCompletions' and Completions'
	// larger of "n" and "best_of", GeminiGenerate's candidateCount; 1 when absent
	// or null, and for the other APIs. Every member a reader may take for one counts, read as
	// the laxest reader reads it (laxCount: 2, 2.0, "2" and true are counts).
	Choices int64
}

// ReadBound reads what r's body asks for, as an upstream of api reads it. It reads the body as
// readBody does (once per request, with Model and IncludeUsage) and passes it on unchanged.
func ReadBound(r *http.Request, api API) Bound {
	b := readBody(r)
	if b == nil {
		return Bound{Refusal: unreadable(r)}
	}
	if !b.parse().object {
		return Bound{Refusal: notJSON}
	}
	if api != 0 && b.boundAPI == api {
		return b.bound
	}
	bd := Bound{Readable: true, Unbounded: unbounded(b.data), Prompt: int64(len(b.data)), Choices: 1}
	top := skipSpace(b.data, 0)
	switch api {
	case ChatCompletions, Completions, Responses, AnthropicMessages:
		readLevel(b.data, top, topLevel[api], &bd)
	case GeminiGenerate:
		readGemini(b.data, top, &bd)
	}
	if api == AnthropicMessages && hasTools(b.data, top) {
		bd.Prompt += AnthropicToolPrompt
	}
	b.bound, b.boundAPI = bd, api
	return bd
}

// AnthropicToolPrompt is what ReadBound adds to the prompt bound of an Anthropic Messages
// request with tools, in tokens: Anthropic adds a tool-use system prompt to such a request,
// which its bytes do not cover (at most 530 tokens in Anthropic's pricing table).
const AnthropicToolPrompt = 600

// hasTools reports whether the JSON object that opens at body[i] has a "tools" member (or one
// folded equal to it) that is neither null nor an empty array.
func hasTools(body []byte, i int) bool {
	found := false
	eachMember(body, i, func(m member) {
		if k, _ := match(anthropicTools, m.name); k < 0 || found {
			return
		}
		v := body[m.start:m.end]
		found = string(v) != "null" && !(v[0] == '[' && v[skipSpace(v, 1)] == ']')
	})
	return found
}

// anthropicTools is the "tools" member of an Anthropic Messages request.
var anthropicTools = []field{{"tools", []string{"tools"}, false}}

// SetOutputCap makes every output cap member of r's body, as api reads it, at most cap
// tokens (cap > 0). A member whose value is not a positive integer at most cap gets cap; one
// is inserted where the body has none spelt as the API spells it, right after the opening '{' of its object
// (max_completion_tokens for ChatCompletions, n_predict not counting; "generationConfig":{"maxOutputTokens":cap} or
// a member of each generationConfig object for GeminiGenerate). With maxTokensToo, a
// ChatCompletions body without max_tokens gets "max_tokens":cap too, for servers that read
// only max_tokens (OpenAI's reasoning models refuse a request that has it). A Gemini generationConfig
// that is not an object becomes {"maxOutputTokens":cap}. Every member a reader may take for
// a cap is rewritten: each of a name given twice, other spellings under case folding. Only
// the bytes of those values change: key order, whitespace and escapes stay. It returns
// whether the body changed; a body already within cap goes on byte for byte, without an
// allocation once parsed. Embeddings, an unknown API, cap <= 0, or a body ReadBound finds
// not Readable: nothing changes. When the body changes, r.Body, r.GetBody, r.ContentLength
// and any Content-Length field are set to what the upstream is to receive, as IncludeUsage
// sets them.
func SetOutputCap(r *http.Request, api API, cap int64, maxTokensToo bool) bool {
	if cap <= 0 || api == 0 || api == Embeddings {
		return false
	}
	b := readBody(r)
	if b == nil || !b.parse().object {
		return false
	}
	changed := false
	capEdits(b.data, api, cap, maxTokensToo, func(capEdit) { changed = true })
	if !changed {
		return false
	}
	out := make([]byte, 0, len(b.data)+64)
	last := 0
	capEdits(b.data, api, cap, maxTokensToo, func(e capEdit) {
		out = append(out, b.data[last:e.start]...)
		out = e.append(out, cap)
		last = e.end
	})
	out = append(out, b.data[last:]...)
	replaceBody(r, b, out)
	return true
}

// field is an output cap or choices member: the names an API reads it by, and that name
// folded (foldName), which every spelling of it shares; insert: a standard cap of the API, one
// every reader of it reads (when the object has none spelt as the API spells it, the level's
// first is inserted).
type field struct {
	folded    string
	spellings []string
	insert    bool
}

// level is the members an object of a request body holds: its output caps (at most 3) and
// its choices counts.
type level struct {
	caps    []field
	choices []field
}

// topLevel is each API's top-level object; GeminiGenerate's caps are in geminiConfig.
var topLevel = [...]level{
	// llama.cpp's server reads n_predict over max_tokens: rewritten when given. vLLM reads
	// best_of in a chat request too.
	ChatCompletions: {
		caps:    []field{{"maxcompletiontokens", []string{"max_completion_tokens"}, true}, {"maxtokens", []string{"max_tokens"}, true}, nPredict},
		choices: []field{{"n", []string{"n"}, false}, {"bestof", []string{"best_of"}, false}},
	},
	Completions: {
		caps:    []field{{"maxtokens", []string{"max_tokens"}, true}, nPredict},
		choices: []field{{"n", []string{"n"}, false}, {"bestof", []string{"best_of"}, false}},
	},
	Responses:         {caps: []field{{"maxoutputtokens", []string{"max_output_tokens"}, true}}},
	AnthropicMessages: {caps: []field{{"maxtokens", []string{"max_tokens"}, true}}},
	GeminiGenerate:    {},
	Embeddings:        {},
}

// geminiTop is GeminiGenerate's top-level generationConfig (proto3 JSON reads both
// spellings), and geminiConfig its members.
var (
	geminiTop    = []field{{"generationconfig", []string{"generationConfig", "generation_config"}, false}}
	geminiConfig = level{
		caps:    []field{{"maxoutputtokens", []string{"maxOutputTokens", "max_output_tokens"}, true}},
		choices: []field{{"candidatecount", []string{"candidateCount", "candidate_count"}, false}},
	}
)

// nPredict is llama.cpp's output cap, which its server reads over max_tokens.
var nPredict = field{"npredict", []string{"n_predict"}, false}

// match returns the index in fs of the field the member name n (as written) is read as, and
// whether n is one of its spellings exactly; -1 when it is none of them.
func match(fs []field, n []byte) (int, bool) {
	var buf [maxFolded]byte
	u := unescapedName(n)
	f := foldName(&buf, u)
	for i, fd := range fs {
		if string(f) != fd.folded {
			continue
		}
		for _, s := range fd.spellings {
			if string(u) == s {
				return i, true
			}
		}
		return i, false
	}
	return -1, false
}

// readLevel reads into bd the caps and choices of the object that opens at body[i], as lv
// describes it: Cap is the largest of the caps' last values (0 when one is not a positive
// integer, or a cap is given in another spelling), Choices the largest choices count. A
// choices count that is not a whole number from 1 to MaxChoices as the laxest reader reads it
// (laxCount) sets bd.Refusal.
func readLevel(body []byte, i int, lv level, bd *Bound) {
	var caps [3]int64 // the last value of each of lv.caps
	folded := false
	eachMember(body, i, func(m member) {
		if k, exact := match(lv.caps, m.name); k >= 0 {
			caps[k] = positiveInt(body[m.start:m.end])
			folded = folded || !exact
		}
		if k, _ := match(lv.choices, m.name); k >= 0 {
			v := body[m.start:m.end]
			if string(v) == "null" {
				return // the default, 1, as every reader reads it
			}
			n, ok := laxCount(v)
			switch {
			case !ok || n < 1:
				bd.Refusal = choicesRefusal(m.name, "is not a whole number of at least 1")
			case n > MaxChoices:
				bd.Refusal = choicesRefusal(m.name, "asks for more than "+strconv.Itoa(MaxChoices)+" outputs")
			default:
				bd.Choices = max(bd.Choices, n)
			}
		}
	})
	bd.Cap = 0
	if !folded {
		bd.Cap = max(caps[0], caps[1], caps[2])
	}
}

// choicesRefusal is the 400 Refusal of a choices member named name (as written) whose value
// is what why says.
func choicesRefusal(name []byte, why string) Refusal {
	return Refusal{http.StatusBadRequest, "the request body's " + strconv.Quote(string(unescapedName(name))) + " " + why}
}

// readGemini reads into bd the generationConfig members of the Gemini request object that
// opens at body[i]: Cap from the last one, Choices from them all. A generationConfig that is
// neither an object nor null makes bd Unbounded.
func readGemini(body []byte, i int, bd *Bound) {
	folded := false
	eachMember(body, i, func(m member) {
		k, exact := match(geminiTop, m.name)
		if k < 0 {
			return
		}
		folded = folded || !exact
		switch body[m.start] {
		case '{':
			readLevel(body, m.start, geminiConfig, bd)
		case 'n': // null: no config
			bd.Cap = 0
		default:
			bd.Unbounded, bd.Cap = true, 0
		}
	})
	if folded {
		bd.Cap = 0
	}
}

// capEdit is one change SetOutputCap makes to a body: body[start:end] is replaced by what
// kind says.
type capEdit struct {
	start, end int
	kind       editKind
	name       string // the member inserted (insertMember)
	comma      bool   // a ',' follows the inserted member: its object has others
}

// editKind is what a capEdit puts in place.
type editKind uint8

const (
	setValue     editKind = iota // the cap
	insertMember                 // "name":cap
	setConfig                    // {"maxOutputTokens":cap}
	insertConfig                 // "generationConfig":{"maxOutputTokens":cap}
)

// append appends what e puts in place to out.
func (e capEdit) append(out []byte, cap int64) []byte {
	switch e.kind {
	case insertMember:
		out = append(strconv.AppendQuote(out, e.name), ':')
	case setConfig:
		out = append(out, `{"maxOutputTokens":`...)
	case insertConfig:
		out = append(out, `"generationConfig":{"maxOutputTokens":`...)
	}
	out = strconv.AppendInt(out, cap, 10)
	if e.kind == setConfig || e.kind == insertConfig {
		out = append(out, '}')
	}
	if e.comma {
		out = append(out, ',')
	}
	return out
}

// capEdits calls edit on each change that makes every output cap of body (a JSON object),
// as api reads it, at most cap, in the order of the body; with maxTokensToo, a
// ChatCompletions body without max_tokens gets one.
func capEdits(body []byte, api API, cap int64, maxTokensToo bool, edit func(capEdit)) {
	top := skipSpace(body, 0)
	if api != GeminiGenerate {
		also := ""
		if maxTokensToo && api == ChatCompletions {
			also = "max_tokens"
		}
		levelEdits(body, top, topLevel[api], cap, also, edit)
		return
	}
	found := false
	eachMember(body, top, func(m member) {
		_, exact := match(geminiTop, m.name)
		found = found || exact
	})
	if !found {
		edit(capEdit{start: top + 1, end: top + 1, kind: insertConfig, comma: hasMembers(body, top)})
	}
	eachMember(body, top, func(m member) {
		if k, _ := match(geminiTop, m.name); k < 0 {
			return
		}
		if body[m.start] == '{' {
			levelEdits(body, m.start, geminiConfig, cap, "", edit)
			return
		}
		edit(capEdit{start: m.start, end: m.end, kind: setConfig})
	})
}

// levelEdits calls edit on each change that makes every cap of lv in the object that opens
// at body[i] at most cap: each cap member whose value is not a positive integer at most cap
// is set to cap; without a member of lv's standard caps (field.insert) spelt as the API spells
// it, lv's first is inserted; without a member spelt also (unless ""), also is inserted.
func levelEdits(body []byte, i int, lv level, cap int64, also string, edit func(capEdit)) {
	found, alsoFound := false, also == ""
	eachMember(body, i, func(m member) {
		k, exact := match(lv.caps, m.name)
		if k >= 0 && exact {
			found = found || lv.caps[k].insert
			alsoFound = alsoFound || string(unescapedName(m.name)) == also
		}
	})
	comma := hasMembers(body, i)
	if !found {
		edit(capEdit{start: i + 1, end: i + 1, kind: insertMember, name: lv.caps[0].spellings[0], comma: comma || !alsoFound})
	}
	if !alsoFound {
		edit(capEdit{start: i + 1, end: i + 1, kind: insertMember, name: also, comma: comma})
	}
	eachMember(body, i, func(m member) {
		if k, _ := match(lv.caps, m.name); k < 0 {
			return
		}
		if v := positiveInt(body[m.start:m.end]); v == 0 || v > cap {
			edit(capEdit{start: m.start, end: m.end, kind: setValue})
		}
	})
}

// hasMembers reports whether the JSON object that opens at body[i] has a member.
func hasMembers(body []byte, i int) bool {
	j := skipSpace(body, i+1)
	return j < len(body) && body[j] != '}'
}
