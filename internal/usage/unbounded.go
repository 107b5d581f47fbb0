package usage

import "bytes"

// unboundedKeys are the member names, folded (foldName), that make a request's prompt
// unbounded by its body's bytes wherever they appear in the body with a value other than
// null. They name content that is not text (images, audio, video, files, documents, inline
// data, file references), context the upstream holds (a previous response, a conversation,
// cached content, a container, MCP servers), server-side tools (web search, file search,
// URL context, code execution, maps, retrieval, computer use), outputs not bounded by the cap
// (predicted outputs, audio and image modalities, speech) and Assistants-style attachments.
// They are not looked for inside the members schemaKeys names.
var unboundedKeys = map[string]bool{
	// Content that is not text, and references to files.
	"imageurl": true, "inputimage": true, "inputaudio": true, "inputfile": true, "inputvideo": true,
	"image": true, "images": true, "imagefile": true, "audio": true, "video": true, "document": true,
	"file": true, "files": true, "fileid": true, "fileurl": true, "filedata": true, "fileuri": true,
	"inlinedata": true, "attachments": true,
	// Context the upstream holds.
	"previousresponseid": true, "conversation": true, "cachedcontent": true, "container": true,
	"mcpservers": true,
	// Server-side tools.
	"websearchoptions": true, "googlesearch": true, "googlesearchretrieval": true,
	"codeexecution": true, "urlcontext": true, "filesearch": true, "googlemaps": true,
	"computeruse": true, "retrieval": true, "enterprisewebsearch": true, "vertexragstore": true,
	"vertexaisearch": true, "toolresources": true,
	// Outputs the output cap may not bound.
	"prediction": true, "modalities": true, "responsemodalities": true, "speechconfig": true,
}

// unboundedTypes are the prefixes of "type" values, folded (foldName), that make a request's
// prompt unbounded wherever they appear: content parts that are not text (image, image_url,
// input_image, input_audio, input_file, file, audio, video, document, container_upload),
// references to stored items (item_reference, compaction) and server-side or
// system-prompted tools and their results (web_search*, web_fetch*, file_search,
// code_interpreter, code_execution*, image_generation, computer*, bash*, text_editor*,
// local_shell, tool_search*, mcp*).
var unboundedTypes = [...][]byte{
	[]byte("image"), []byte("inputimage"), []byte("inputaudio"), []byte("inputfile"), []byte("inputvideo"),
	[]byte("file"), []byte("audio"), []byte("video"), []byte("document"), []byte("container"),
	[]byte("itemreference"), []byte("compaction"),
	[]byte("websearch"), []byte("webfetch"), []byte("codeinterpreter"), []byte("codeexecution"),
	[]byte("computer"), []byte("bash"), []byte("texteditor"), []byte("localshell"),
	[]byte("toolsearch"), []byte("mcp"),
}

// schemaKeys are the member names, folded (foldName), whose values hold no content an upstream
// reads as the prompt: the JSON schemas of tools (OpenAI's "parameters", Anthropic's
// "input_schema", Gemini's "functionDeclarations" and "parametersJsonSchema"), of structured
// outputs ("response_format", "schema", "json_schema", Gemini's "responseSchema" and
// "responseJsonSchema") and the client's "metadata". A tool parameter named "image" or a
// metadata value "file" names no content. unbounded skips their values whole.
var schemaKeys = map[string]bool{
	"parameters": true, "inputschema": true, "functiondeclarations": true, "parametersjsonschema": true,
	"responseformat": true, "schema": true, "jsonschema": true, "responseschema": true,
	"responsejsonschema": true, "metadata": true,
}

// promptObjectKey is the folded name of the Responses API's stored prompt template
// ({"prompt": {"id": ...}}), unbounded when its value is an object: a legacy completion's
// "prompt" is text or tokens.
const promptObjectKey = "prompt"

// unbounded reports whether body, a JSON text encoding/json accepts, has a member that
// unboundedKeys lists with a value other than null, a "type" member whose string value
// begins with one of unboundedTypes, or a "prompt" whose value is an object, at any depth but
// within the value of a member that schemaKeys lists.
// It reads the body in one pass and allocates only for names written with escapes.
func unbounded(body []byte) bool {
	var buf [maxFolded]byte
	for i := 0; ; {
		q := bytes.IndexByte(body[i:], '"')
		if q < 0 {
			return false
		}
		start := i + q
		end := stringEnd(body, start)
		i = skipSpace(body, end)
		if i >= len(body) || body[i] != ':' {
			continue // a string value
		}
		v := skipSpace(body, i+1)
		i = v
		name := foldName(&buf, unescapedName(body[start+1:end-1]))
		switch {
		case name == nil:
		case string(name) == "type":
			if v < len(body) && body[v] == '"' {
				vend := stringEnd(body, v)
				i = vend
				if unboundedType(unescapedName(body[v+1 : vend-1])) {
					return true
				}
			}
		case string(name) == promptObjectKey:
			if v < len(body) && body[v] == '{' {
				return true
			}
		case unboundedKeys[string(name)]:
			if !bytes.HasPrefix(body[v:], []byte("null")) {
				return true
			}
		case schemaKeys[string(name)]:
			i = valueEnd(body, v)
		}
	}
}

// unboundedType reports whether the "type" value t (unescaped) begins, folded, with one of
// unboundedTypes.
func unboundedType(t []byte) bool {
	var buf [maxFolded]byte
	if len(t) > maxFolded {
		t = t[:maxFolded] // a prefix is enough: its own prefixes are what is looked for
	}
	f := foldName(&buf, t)
	for _, p := range unboundedTypes {
		if bytes.HasPrefix(f, p) {
			return true
		}
	}
	return false
}
