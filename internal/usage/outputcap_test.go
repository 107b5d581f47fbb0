package usage

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// TestAPIOf: the API of a request is read from its URL path's end.
func TestAPIOf(t *testing.T) {
	t.Parallel()
	for path, want := range map[string]API{
		"/v1/chat/completions":                   ChatCompletions,
		"/openai/deployments/d/chat/completions": ChatCompletions,
		"chat/completions":                       ChatCompletions,
		"/v1/completions":                        Completions,
		"/v1/xchat/completions":                  Completions,
		"/v1/responses":                          Responses,
		"/v1/messages":                           AnthropicMessages,
		"/v1/embeddings":                         Embeddings,
		"/v1beta/models/gemini-2.5-flash:generateContent":                                      GeminiGenerate,
		"/v1beta/models/gemini-2.5-pro:streamGenerateContent":                                  GeminiGenerate,
		"/v1/projects/p/locations/l/publishers/google/models/gemini-2.5-flash:generateContent": GeminiGenerate,
		"/v1beta/tunedModels/t:generateContent":                                                GeminiGenerate,
		"/v1beta/models/:generateContent":                                                      0,
		"/v1beta/files/f:generateContent":                                                      0,
		"/v1beta/models/m:countTokens":                                                         0,
		"/v1/messages/count_tokens":                                                            0,
		"/v1/responses/resp_1":                                                                 0,
		"/v1/chat/completions/":                                                                0,
		"/v1/Chat/Completions":                                                                 0,
		"/v1/models":                                                                           0,
		"":                                                                                     0,
		"/":                                                                                    0,
		"/v1beta/models/m:generateContentx":                                                    0,
		"/v1beta/models/m:generateContent/extra":                                               0,
		"models/gemini:streamGenerateContent":                                                  GeminiGenerate,
		"/v1/engines/davinci/completions":                                                      Completions,
		"/api/v1/chat/completions":                                                             ChatCompletions,
		"/v1beta/openai/chat/completions":                                                      ChatCompletions,
		"/anthropic/v1/messages":                                                               AnthropicMessages,
		"/v1/audio/speech":                                                                     0,
		"/v1/images/generations":                                                               0,
		"/v1/embeddings/x":                                                                     0,
		"/v1beta/models/gemini:batchEmbedContents":                                             0,
	} {
		if got := APIOf(path); got != want {
			t.Errorf("APIOf(%q) = %d, want %d", path, got, want)
		}
	}
}

// capCase is a request body, what ReadBound reads from it, and what SetOutputCap makes of it
// with cap 50 ("" when it leaves the body as it came).
type capCase struct {
	name      string
	api       API
	body      string
	cap       int64 // Bound.Cap
	choices   int64 // Bound.Choices; 0 means 1
	unbounded bool
	want      string
	prompt    int64 // Bound.Prompt beyond the body's length
}

// capCases are the table of TestOutputCap and the seeds of FuzzSetOutputCap.
var capCases = []capCase{
	// Chat Completions.
	{"chat: cap rewritten", ChatCompletions, `{"model":"m","max_completion_tokens":4000,"messages":[]}`, 4000, 1, false, `{"model":"m","max_completion_tokens":50,"messages":[]}`, 0},
	{"chat: absent", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, 0, 1, false, `{"max_completion_tokens":50,"model":"m","messages":[{"role":"user","content":"hi"}]}`, 0},
	{"chat: absent, whitespace", ChatCompletions, " {\n  \"model\": \"m\"\n}\n", 0, 1, false, " {\"max_completion_tokens\":50,\n  \"model\": \"m\"\n}\n", 0},
	{"chat: empty object", ChatCompletions, `{}`, 0, 1, false, `{"max_completion_tokens":50}`, 0},
	{"chat: empty object with space", ChatCompletions, `{ }`, 0, 1, false, `{"max_completion_tokens":50 }`, 0},
	{"chat: zero", ChatCompletions, `{"max_tokens":0,"messages":[]}`, 0, 1, false, `{"max_tokens":50,"messages":[]}`, 0},
	{"chat: negative", ChatCompletions, `{"max_tokens":-5}`, 0, 1, false, `{"max_tokens":50}`, 0},
	{"chat: a string", ChatCompletions, `{"max_tokens":"100"}`, 0, 1, false, `{"max_tokens":50}`, 0},
	{"chat: a string within cap", ChatCompletions, `{"max_tokens":"10"}`, 0, 1, false, `{"max_tokens":50}`, 0},
	{"chat: an exponent", ChatCompletions, `{"max_completion_tokens":1e2}`, 0, 1, false, `{"max_completion_tokens":50}`, 0},
	{"chat: a fraction", ChatCompletions, `{"max_completion_tokens":100.0}`, 0, 1, false, `{"max_completion_tokens":50}`, 0},
	{"chat: a fraction within cap", ChatCompletions, `{"max_completion_tokens":10.5}`, 0, 1, false, `{"max_completion_tokens":50}`, 0},
	{"chat: true", ChatCompletions, `{"max_tokens":true}`, 0, 1, false, `{"max_tokens":50}`, 0},
	{"chat: null", ChatCompletions, `{"max_tokens":null}`, 0, 1, false, `{"max_tokens":50}`, 0},
	{"chat: an object", ChatCompletions, `{"max_tokens":{"a":[1,"}"]},"x":1}`, 0, 1, false, `{"max_tokens":50,"x":1}`, 0},
	{"chat: over int64", ChatCompletions, `{"max_tokens":99999999999999999999}`, 0, 1, false, `{"max_tokens":50}`, 0},
	{"chat: duplicated, the last within cap", ChatCompletions, `{"max_tokens":4000,"max_tokens":30}`, 30, 1, false, `{"max_tokens":50,"max_tokens":30}`, 0},
	{"chat: duplicated, the last over cap", ChatCompletions, `{"max_tokens":30,"max_tokens":4000}`, 4000, 1, false, `{"max_tokens":30,"max_tokens":50}`, 0},
	{"chat: duplicated, the last a string", ChatCompletions, `{"max_tokens":30,"max_tokens":"40"}`, 0, 1, false, `{"max_tokens":30,"max_tokens":50}`, 0},
	{"chat: both, max_tokens larger", ChatCompletions, `{"max_tokens":100,"max_completion_tokens":20}`, 100, 1, false, `{"max_tokens":50,"max_completion_tokens":20}`, 0},
	{"chat: both, max_completion_tokens larger", ChatCompletions, `{"max_completion_tokens":4000,"messages":[],"max_tokens":60}`, 4000, 1, false, `{"max_completion_tokens":50,"messages":[],"max_tokens":50}`, 0},
	{"chat: both within cap", ChatCompletions, `{"max_completion_tokens":40,"max_tokens":50}`, 50, 1, false, "", 0},
	{"chat: within cap", ChatCompletions, `{"model":"m","max_completion_tokens":50,"messages":[]}`, 50, 1, false, "", 0},
	{"chat: within cap, spaced and escaped", ChatCompletions, "{ \"max_tokens\" :\t10 , \"messages\":[{\"content\":\"a\\\"b\\\\\"}] }", 10, 1, false, "", 0},
	{"chat: spaces kept around the value", ChatCompletions, `{"max_tokens" :  4000 , "x":1}`, 4000, 1, false, `{"max_tokens" :  50 , "x":1}`, 0},
	{"chat: an escaped name", ChatCompletions, `{"max\u005ftokens":4000}`, 4000, 1, false, `{"max\u005ftokens":50}`, 0},
	{"chat: another spelling", ChatCompletions, `{"max_tokens":10,"Max_Tokens":4000}`, 0, 1, false, `{"max_tokens":10,"Max_Tokens":50}`, 0},
	{"chat: the Kelvin sign", ChatCompletions, `{"max_to` + "\u212a" + `ens":4000}`, 0, 1, false, `{"max_completion_tokens":50,"max_to` + "\u212a" + `ens":50}`, 0},
	{"chat: another spelling alone", ChatCompletions, `{"Max_Tokens":40}`, 0, 1, false, `{"max_completion_tokens":50,"Max_Tokens":40}`, 0},
	{"gemini: another spelling alone", GeminiGenerate, `{"GenerationConfig":{"maxOutputTokens":4000}}`, 0, 1, false, `{"generationConfig":{"maxOutputTokens":50},"GenerationConfig":{"maxOutputTokens":50}}`, 0},
	{"chat: nested only", ChatCompletions, `{"messages":[{"max_tokens":4000}],"meta":{"max_tokens":1}}`, 0, 1, false, `{"max_completion_tokens":50,"messages":[{"max_tokens":4000}],"meta":{"max_tokens":1}}`, 0},
	{"chat: a string mentioning the cap", ChatCompletions, `{"messages":[{"content":"\"max_tokens\":9000"}]}`, 0, 1, false, `{"max_completion_tokens":50,"messages":[{"content":"\"max_tokens\":9000"}]}`, 0},
	{"chat: n", ChatCompletions, `{"n":3,"max_tokens":10}`, 10, 3, false, "", 0},
	{"chat: n null", ChatCompletions, `{"n":null,"max_tokens":10}`, 10, 1, false, "", 0},
	{"chat: n 128", ChatCompletions, `{"n":128,"max_tokens":10}`, 10, 128, false, "", 0},
	{"chat: n a string", ChatCompletions, `{"n":"2","max_tokens":10}`, 10, 2, false, "", 0},
	{"chat: n a spaced string", ChatCompletions, `{"n":" 3 ","max_tokens":10}`, 10, 3, false, "", 0},
	{"chat: n a string with a fraction", ChatCompletions, `{"n":"3.0","max_tokens":10}`, 10, 3, false, "", 0},
	{"chat: n 1.0", ChatCompletions, `{"n":1.0,"max_tokens":10}`, 10, 1, false, "", 0},
	{"chat: n 2e0", ChatCompletions, `{"n":2e0,"max_tokens":10}`, 10, 2, false, "", 0},
	{"chat: n true", ChatCompletions, `{"n":true,"max_tokens":10}`, 10, 1, false, "", 0},
	{"chat: n_predict rewritten", ChatCompletions, `{"max_tokens":10,"n_predict":50000}`, 50000, 1, false, `{"max_tokens":10,"n_predict":50}`, 0},
	{"chat: n_predict -1", ChatCompletions, `{"max_tokens":10,"n_predict":-1}`, 10, 1, false, `{"max_tokens":10,"n_predict":50}`, 0},
	{"chat: n_predict alone", ChatCompletions, `{"n_predict":40}`, 40, 1, false, `{"max_completion_tokens":50,"n_predict":40}`, 0},
	{"completions: n_predict rewritten", Completions, `{"prompt":"hi","n_predict":4000}`, 4000, 1, false, `{"max_tokens":50,"prompt":"hi","n_predict":50}`, 0},
	{"chat: a tool parameter named file", ChatCompletions, `{"max_tokens":10,"tools":[{"type":"function","function":{"name":"save","parameters":{"type":"object","properties":{"file":{"type":"string"},"type":{"type":"string","enum":["image"]}}}}}]}`, 10, 1, false, "", 0},
	{"chat: metadata image", ChatCompletions, `{"max_tokens":10,"metadata":{"image":"x"}}`, 10, 1, false, "", 0},
	{"chat: a response_format schema", ChatCompletions, `{"max_tokens":10,"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"properties":{"image_url":{"type":"string"}}}}}}`, 10, 1, false, "", 0},
	{"chat: an image after a tool schema", ChatCompletions, `{"tools":[{"type":"function","function":{"name":"f","parameters":{"file":{}}}}],"max_tokens":10,"messages":[{"content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`, 10, 1, true, "", 0},
	{"chat: a tool result with an image", ChatCompletions, `{"max_tokens":10,"messages":[{"role":"tool","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`, 10, 1, true, "", 0},
	{"chat: best_of (vLLM)", ChatCompletions, `{"n":2,"best_of":3.0,"max_tokens":10}`, 10, 3, false, "", 0},
	{"chat: n duplicated", ChatCompletions, `{"n":4,"n":2,"max_tokens":10}`, 10, 4, false, "", 0},
	{"chat: N", ChatCompletions, `{"n":1,"N":5,"max_tokens":10}`, 10, 5, false, "", 0},
	{"chat: image_url", ChatCompletions, `{"max_tokens":10,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}]}`, 10, 1, true, "", 0},
	{"chat: input_audio", ChatCompletions, `{"max_tokens":10,"messages":[{"content":[{"type":"input_audio","input_audio":{"data":"AAA","format":"wav"}}]}]}`, 10, 1, true, "", 0},
	{"chat: file", ChatCompletions, `{"max_tokens":10,"messages":[{"content":[{"type":"file","file":{"file_id":"f"}}]}]}`, 10, 1, true, "", 0},
	{"chat: file_id alone", ChatCompletions, `{"max_tokens":10,"messages":[{"content":[{"x":{"file_id":"f"}}]}]}`, 10, 1, true, "", 0},
	{"chat: an escaped type", ChatCompletions, `{"max_tokens":10,"messages":[{"content":[{"type":"im\u0061ge_url"}]}]}`, 10, 1, true, "", 0},
	{"chat: web_search_options", ChatCompletions, `{"max_tokens":10,"web_search_options":{}}`, 10, 1, true, "", 0},
	{"chat: audio output", ChatCompletions, `{"max_tokens":10,"modalities":["text","audio"],"audio":{"voice":"alloy"}}`, 10, 1, true, "", 0},
	{"chat: a prediction", ChatCompletions, `{"max_tokens":10,"prediction":{"type":"content","content":"x"}}`, 10, 1, true, "", 0},
	{"chat: a null file is none", ChatCompletions, `{"max_tokens":10,"file":null}`, 10, 1, false, "", 0},
	{"chat: text parts", ChatCompletions, `{"max_tokens":10,"messages":[{"content":[{"type":"text","text":"image_url"}]}],"tools":[{"type":"function","function":{"name":"f"}}]}`, 10, 1, false, "", 0},
	// Legacy Completions.
	{"completions: absent", Completions, `{"model":"m","prompt":"hi"}`, 0, 1, false, `{"max_tokens":50,"model":"m","prompt":"hi"}`, 0},
	{"completions: rewritten", Completions, `{"prompt":"hi","max_tokens":4000}`, 4000, 1, false, `{"prompt":"hi","max_tokens":50}`, 0},
	{"completions: max_completion_tokens is not its cap", Completions, `{"prompt":"hi","max_completion_tokens":10}`, 0, 1, false, `{"max_tokens":50,"prompt":"hi","max_completion_tokens":10}`, 0},
	{"completions: best_of larger than n", Completions, `{"prompt":"hi","max_tokens":10,"n":2,"best_of":5}`, 10, 5, false, "", 0},
	{"completions: token prompt", Completions, `{"prompt":[1,2,3],"max_tokens":10}`, 10, 1, false, "", 0},
	// Responses.
	{"responses: rewritten", Responses, `{"model":"m","input":"hi","max_output_tokens":4000}`, 4000, 1, false, `{"model":"m","input":"hi","max_output_tokens":50}`, 0},
	{"responses: absent", Responses, `{"model":"m","input":"hi"}`, 0, 1, false, `{"max_output_tokens":50,"model":"m","input":"hi"}`, 0},
	{"responses: max_tokens is not its cap", Responses, `{"input":"hi","max_tokens":10}`, 0, 1, false, `{"max_output_tokens":50,"input":"hi","max_tokens":10}`, 0},
	{"responses: zero", Responses, `{"input":"hi","max_output_tokens":0}`, 0, 1, false, `{"input":"hi","max_output_tokens":50}`, 0},
	{"responses: within cap", Responses, `{"input":"hi","max_output_tokens":49}`, 49, 1, false, "", 0},
	{"responses: n is not read", Responses, `{"input":"hi","max_output_tokens":49,"n":"x"}`, 49, 1, false, "", 0},
	{"responses: previous_response_id", Responses, `{"input":"hi","previous_response_id":"resp_1","max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: conversation", Responses, `{"input":"hi","conversation":"conv_1","max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: input_image", Responses, `{"input":[{"role":"user","content":[{"type":"input_image","image_url":"data:x"}]}],"max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: input_file", Responses, `{"input":[{"role":"user","content":[{"type":"input_file","file_data":"x"}]}],"max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: web_search", Responses, `{"input":"hi","tools":[{"type":"web_search_preview"}],"max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: file_search", Responses, `{"input":"hi","tools":[{"type":"file_search","vector_store_ids":["v"]}],"max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: mcp", Responses, `{"input":"hi","tools":[{"type":"mcp","server_url":"u"}],"max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: code_interpreter", Responses, `{"input":"hi","tools":[{"type":"code_interpreter"}],"max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: item_reference", Responses, `{"input":[{"type":"item_reference","id":"msg_1"}],"max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: a stored prompt", Responses, `{"prompt":{"id":"pmpt_1"},"max_output_tokens":49}`, 49, 1, true, "", 0},
	{"responses: function tools", Responses, `{"input":"hi","tools":[{"type":"function","name":"f","parameters":{"type":"object"}}],"max_output_tokens":49}`, 49, 1, false, "", 0},
	// Anthropic Messages.
	{"anthropic: rewritten", AnthropicMessages, `{"model":"claude","max_tokens":4096,"messages":[{"role":"user","content":"hi"}]}`, 4096, 1, false, `{"model":"claude","max_tokens":50,"messages":[{"role":"user","content":"hi"}]}`, 0},
	{"anthropic: absent", AnthropicMessages, `{"model":"claude","messages":[]}`, 0, 1, false, `{"max_tokens":50,"model":"claude","messages":[]}`, 0},
	{"anthropic: negative", AnthropicMessages, `{"max_tokens":-1,"messages":[]}`, 0, 1, false, `{"max_tokens":50,"messages":[]}`, 0},
	{"anthropic: duplicated", AnthropicMessages, `{"max_tokens":4096,"messages":[],"max_tokens":1}`, 1, 1, false, `{"max_tokens":50,"messages":[],"max_tokens":1}`, 0},
	{"anthropic: max_completion_tokens is not its cap", AnthropicMessages, `{"max_tokens":10,"max_completion_tokens":4000}`, 10, 1, false, "", 0},
	{"anthropic: n is not read", AnthropicMessages, `{"max_tokens":10,"n":1000}`, 10, 1, false, "", 0},
	{"anthropic: image", AnthropicMessages, `{"max_tokens":10,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","data":"x"}}]}]}`, 10, 1, true, "", 0},
	{"anthropic: document", AnthropicMessages, `{"max_tokens":10,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"text","data":"x"}}]}]}`, 10, 1, true, "", 0},
	{"anthropic: web_search", AnthropicMessages, `{"max_tokens":10,"tools":[{"type":"web_search_20250305","name":"web_search"}]}`, 10, 1, true, "", AnthropicToolPrompt},
	{"anthropic: code_execution", AnthropicMessages, `{"max_tokens":10,"tools":[{"type":"code_execution_20250825","name":"code_execution"}]}`, 10, 1, true, "", AnthropicToolPrompt},
	{"anthropic: bash", AnthropicMessages, `{"max_tokens":10,"tools":[{"type":"bash_20250124","name":"bash"}]}`, 10, 1, true, "", AnthropicToolPrompt},
	{"anthropic: mcp_servers", AnthropicMessages, `{"max_tokens":10,"mcp_servers":[{"type":"url","url":"u","name":"n"}]}`, 10, 1, true, "", 0},
	{"anthropic: container", AnthropicMessages, `{"max_tokens":10,"container":"c"}`, 10, 1, true, "", 0},
	{"anthropic: tools", AnthropicMessages, `{"max_tokens":10,"tools":[{"name":"f","input_schema":{"type":"object"}}]}`, 10, 1, false, "", AnthropicToolPrompt},
	{"anthropic: a tool parameter named image", AnthropicMessages, `{"max_tokens":10,"tools":[{"name":"t","input_schema":{"type":"object","properties":{"image":{"type":"string"}}}}]}`, 10, 1, false, "", AnthropicToolPrompt},
	{"anthropic: a tool result with an image", AnthropicMessages, `{"max_tokens":10,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"image","source":{"type":"base64","data":"x"}}]}]}]}`, 10, 1, true, "", 0},
	{"anthropic: tools spaced", AnthropicMessages, `{"max_tokens":10,"tools": [ {"name":"f"} ] }`, 10, 1, false, "", AnthropicToolPrompt},
	{"anthropic: no tools", AnthropicMessages, `{"max_tokens":10,"tools":[ ],"x":{"tools":[1]}}`, 10, 1, false, "", 0},
	{"anthropic: null tools", AnthropicMessages, `{"max_tokens":10,"tools":null}`, 10, 1, false, "", 0},
	{"chat: tools add no prompt", ChatCompletions, `{"max_tokens":10,"tools":[{"type":"function","function":{"name":"f"}}]}`, 10, 1, false, "", 0},
	{"anthropic: thinking", AnthropicMessages, `{"max_tokens":10,"thinking":{"type":"enabled","budget_tokens":5},"system":"s"}`, 10, 1, false, "", 0},
	// Gemini.
	{"gemini: rewritten", GeminiGenerate, `{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":4000,"temperature":1}}`, 4000, 1, false, `{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":50,"temperature":1}}`, 0},
	{"gemini: snake case", GeminiGenerate, `{"contents":[],"generation_config":{"max_output_tokens":4000}}`, 4000, 1, false, `{"contents":[],"generation_config":{"max_output_tokens":50}}`, 0},
	{"gemini: mixed case", GeminiGenerate, `{"generationConfig":{"max_output_tokens":4000}}`, 4000, 1, false, `{"generationConfig":{"max_output_tokens":50}}`, 0},
	{"gemini: no config", GeminiGenerate, `{"contents":[]}`, 0, 1, false, `{"generationConfig":{"maxOutputTokens":50},"contents":[]}`, 0},
	{"gemini: empty body object", GeminiGenerate, `{}`, 0, 1, false, `{"generationConfig":{"maxOutputTokens":50}}`, 0},
	{"gemini: config without a cap", GeminiGenerate, `{"contents":[],"generationConfig":{"temperature":1}}`, 0, 1, false, `{"contents":[],"generationConfig":{"maxOutputTokens":50,"temperature":1}}`, 0},
	{"gemini: empty config", GeminiGenerate, `{"contents":[],"generationConfig":{}}`, 0, 1, false, `{"contents":[],"generationConfig":{"maxOutputTokens":50}}`, 0},
	{"gemini: null config", GeminiGenerate, `{"contents":[],"generationConfig":null}`, 0, 1, false, `{"contents":[],"generationConfig":{"maxOutputTokens":50}}`, 0},
	{"gemini: config a string", GeminiGenerate, `{"generationConfig":"x","contents":[]}`, 0, 1, true, `{"generationConfig":{"maxOutputTokens":50},"contents":[]}`, 0},
	{"gemini: config an array", GeminiGenerate, `{"generationConfig":[{"maxOutputTokens":1}]}`, 0, 1, true, `{"generationConfig":{"maxOutputTokens":50}}`, 0},
	{"gemini: both spellings", GeminiGenerate, `{"generationConfig":{"maxOutputTokens":4000},"generation_config":{"temperature":1}}`, 0, 1, false, `{"generationConfig":{"maxOutputTokens":50},"generation_config":{"maxOutputTokens":50,"temperature":1}}`, 0},
	{"gemini: both caps", GeminiGenerate, `{"generationConfig":{"maxOutputTokens":10,"max_output_tokens":4000}}`, 4000, 1, false, `{"generationConfig":{"maxOutputTokens":10,"max_output_tokens":50}}`, 0},
	{"gemini: a string cap", GeminiGenerate, `{"generationConfig":{"maxOutputTokens":"100"}}`, 0, 1, false, `{"generationConfig":{"maxOutputTokens":50}}`, 0},
	{"gemini: within cap", GeminiGenerate, `{"contents":[],"generationConfig":{"maxOutputTokens":50}}`, 50, 1, false, "", 0},
	{"gemini: a top-level cap is not read", GeminiGenerate, `{"maxOutputTokens":10}`, 0, 1, false, `{"generationConfig":{"maxOutputTokens":50},"maxOutputTokens":10}`, 0},
	{"gemini: candidateCount", GeminiGenerate, `{"generationConfig":{"maxOutputTokens":10,"candidateCount":4}}`, 10, 4, false, "", 0},
	{"gemini: candidate_count", GeminiGenerate, `{"generation_config":{"candidate_count":2,"maxOutputTokens":10}}`, 10, 2, false, "", 0},
	{"gemini: inlineData", GeminiGenerate, `{"contents":[{"parts":[{"inlineData":{"mimeType":"image/png","data":"x"}}]}],"generationConfig":{"maxOutputTokens":10}}`, 10, 1, true, "", 0},
	{"gemini: inline_data", GeminiGenerate, `{"contents":[{"parts":[{"inline_data":{"mime_type":"audio/wav","data":"x"}}]}],"generationConfig":{"maxOutputTokens":10}}`, 10, 1, true, "", 0},
	{"gemini: fileData", GeminiGenerate, `{"contents":[{"parts":[{"fileData":{"fileUri":"gs://x"}}]}],"generationConfig":{"maxOutputTokens":10}}`, 10, 1, true, "", 0},
	{"gemini: cachedContent", GeminiGenerate, `{"cachedContent":"cachedContents/c","generationConfig":{"maxOutputTokens":10}}`, 10, 1, true, "", 0},
	{"gemini: googleSearch", GeminiGenerate, `{"tools":[{"googleSearch":{}}],"generationConfig":{"maxOutputTokens":10}}`, 10, 1, true, "", 0},
	{"gemini: url_context", GeminiGenerate, `{"tools":[{"url_context":{}}],"generationConfig":{"maxOutputTokens":10}}`, 10, 1, true, "", 0},
	{"gemini: codeExecution", GeminiGenerate, `{"tools":[{"codeExecution":{}}],"generationConfig":{"maxOutputTokens":10}}`, 10, 1, true, "", 0},
	{"gemini: a function parameter named document", GeminiGenerate, `{"contents":[],"tools":[{"functionDeclarations":[{"name":"t","parameters":{"type":"object","properties":{"document":{"type":"string"}}}}]}],"generationConfig":{"maxOutputTokens":10}}`, 10, 1, false, "", 0},
	{"gemini: candidateCount 2.0", GeminiGenerate, `{"generationConfig":{"maxOutputTokens":10,"candidateCount":2.0}}`, 10, 2, false, "", 0},
	{"gemini: a responseSchema", GeminiGenerate, `{"generationConfig":{"maxOutputTokens":10,"responseSchema":{"properties":{"image":{"type":"STRING"}}}}}`, 10, 1, false, "", 0},
	{"gemini: function declarations", GeminiGenerate, `{"tools":[{"functionDeclarations":[{"name":"f"}]}],"systemInstruction":{"parts":[{"text":"s"}]},"generationConfig":{"maxOutputTokens":10}}`, 10, 1, false, "", 0},
	// Embeddings and unknown APIs: nothing to cap.
	{"embeddings", Embeddings, `{"input":"hi","max_tokens":4000}`, 0, 1, false, "", 0},
	{"unknown", 0, `{"input":"hi","max_tokens":4000}`, 0, 1, false, "", 0},
}

// refusedCases are bodies whose choices count is not a whole number from 1 to MaxChoices as
// the laxest reader reads it: ReadBound's Refusal is a 400 that names the member.
var refusedCases = []struct {
	name   string
	api    API
	body   string
	member string
}{
	{"chat: n 129", ChatCompletions, `{"n":129,"max_tokens":10}`, `"n"`},
	{"chat: n \"129\"", ChatCompletions, `{"n":"129","max_tokens":10}`, `"n"`},
	{"chat: n 1e3", ChatCompletions, `{"n":1e3,"max_tokens":10}`, `"n"`},
	{"chat: n over int64", ChatCompletions, `{"n":99999999999999999999}`, `"n"`},
	{"chat: n 0", ChatCompletions, `{"n":0,"max_tokens":10}`, `"n"`},
	{"chat: n -1", ChatCompletions, `{"n":-1}`, `"n"`},
	{"chat: n false", ChatCompletions, `{"n":false}`, `"n"`},
	{"chat: n 1.5", ChatCompletions, `{"n":1.5,"max_tokens":10}`, `"n"`},
	{"chat: n x", ChatCompletions, `{"n":"x"}`, `"n"`},
	{"chat: n 1_0", ChatCompletions, `{"n":"1_0"}`, `"n"`},
	{"chat: n an object", ChatCompletions, `{"n":{}}`, `"n"`},
	{"chat: n an array", ChatCompletions, `{"n":[2]}`, `"n"`},
	{"chat: N 200", ChatCompletions, `{"n":1,"N":200}`, `"N"`},
	{"completions: best_of over 128", Completions, `{"prompt":"hi","max_tokens":10,"best_of":1000}`, `"best_of"`},
	{"gemini: candidateCount over 128", GeminiGenerate, `{"generationConfig":{"maxOutputTokens":10,"candidateCount":200}}`, `"candidateCount"`},
	{"gemini: candidateCount 1.5", GeminiGenerate, `{"generationConfig":{"candidateCount":1.5}}`, `"candidateCount"`},
}

// unreadableCases are bodies ReadBound does not read (Readable false), which SetOutputCap
// leaves as they came.
var unreadableCases = []struct {
	name, body string
	gzip       bool
	status     int // Bound.Refusal's
}{
	{"not JSON", `{"max_tokens":4000`, false, 400},
	{"trailing bytes", `{"max_tokens":4000} x`, false, 400},
	{"a second object", `{"max_tokens":4000}{}`, false, 400},
	{"an array", `[{"max_tokens":4000}]`, false, 400},
	{"a string", `"max_tokens"`, false, 400},
	{"empty", ``, false, 400},
	{"a byte order mark", "\xef\xbb\xbf" + `{"max_tokens":4000}`, false, 400},
	{"UTF-16", "{\x00}\x00", false, 400},
	{"compressed", `{"max_tokens":4000}`, true, 415},
	{"over 1 MiB", `{"max_tokens":4000,"pad":"` + strings.Repeat(" ", MaxRequestBody) + `"}`, false, 413},
}

// TestOutputCap: for each API shape, ReadBound reads the request's cap, choices, prompt bound
// and unboundedness; SetOutputCap(50) makes exactly the change the table gives (every cap
// member at most 50, one inserted where none is, the rest of the body byte for byte), sets
// the length fields, and leaves a body within the cap as it came; what it makes is JSON with
// every cap at most 50 and nothing else changed.
func TestOutputCap(t *testing.T) {
	t.Parallel()
	for _, tc := range capCases {
		r := jsonRequest(http.MethodPost, "application/json", tc.body)
		r.Header.Set("Content-Length", strconv.Itoa(len(tc.body)))
		b := ReadBound(r, tc.api)
		want := Bound{Readable: true, Unbounded: tc.unbounded, Prompt: int64(len(tc.body)) + tc.prompt, Cap: tc.cap, Choices: tc.choices}
		if b != want {
			t.Errorf("%s: ReadBound %+v, want %+v", tc.name, b, want)
		}
		changed := SetOutputCap(r, tc.api, 50, false)
		sent := tc.want
		if sent == "" {
			sent = tc.body
		}
		got, _ := io.ReadAll(r.Body)
		again, _ := r.GetBody()
		resent, _ := io.ReadAll(again)
		switch {
		case changed != (tc.want != ""):
			t.Errorf("%s: SetOutputCap reports %v", tc.name, changed)
		case string(got) != sent || string(resent) != sent:
			t.Errorf("%s: sent %s (again %s), want %s", tc.name, got, resent, sent)
		case r.ContentLength != int64(len(sent)) || r.Header.Get("Content-Length") != strconv.Itoa(len(sent)):
			t.Errorf("%s: length %d, field %s, want %d", tc.name, r.ContentLength, r.Header.Get("Content-Length"), len(sent))
		}
		if tc.api != 0 && tc.api != Embeddings {
			checkCapped(t, tc.api, []byte(tc.body), got, 50)
		}
	}
	for _, tc := range refusedCases {
		r := jsonRequest(http.MethodPost, "application/json", tc.body)
		b := ReadBound(r, tc.api)
		if !b.Readable || b.Refusal.Status != http.StatusBadRequest || !strings.Contains(b.Refusal.Reason, tc.member) {
			t.Errorf("%s: ReadBound %+v, want a 400 naming %s", tc.name, b, tc.member)
		}
	}
	for _, tc := range unreadableCases {
		for _, api := range []API{ChatCompletions, Completions, Responses, AnthropicMessages, GeminiGenerate} {
			r := jsonRequest(http.MethodPost, "application/json", tc.body)
			if tc.gzip {
				r.Header.Set("Content-Encoding", "gzip")
			}
			if b := ReadBound(r, api); b.Readable || b.Refusal.Status != tc.status || b != (Bound{Refusal: b.Refusal}) {
				t.Errorf("%s (%d): ReadBound %+v, want not readable, refused %d", tc.name, api, b, tc.status)
			}
			if SetOutputCap(r, api, 50, false) {
				t.Errorf("%s (%d): SetOutputCap changed the body", tc.name, api)
			}
			if got, _ := io.ReadAll(r.Body); string(got) != tc.body {
				t.Errorf("%s (%d): the body went on as %d bytes, not as it came (%d)", tc.name, api, len(got), len(tc.body))
			}
		}
	}
}

// TestContentEncodingIdentity: a body sent with Content-Encoding: identity is not compressed,
// and is read.
func TestContentEncodingIdentity(t *testing.T) {
	t.Parallel()
	r := jsonRequest(http.MethodPost, "application/json", `{"max_tokens":10}`)
	r.Header.Set("Content-Encoding", "Identity")
	if b := ReadBound(r, ChatCompletions); !b.Readable || b.Cap != 10 {
		t.Fatalf("ReadBound %+v, want read, cap 10", b)
	}
}

// TestSetOutputCapMaxTokensToo: with maxTokensToo, a chat request without max_tokens gets one
// beside its max_completion_tokens (given or inserted); one with max_tokens, and the other
// APIs, get nothing more.
func TestSetOutputCapMaxTokensToo(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		api        API
		body, want string
	}{
		{ChatCompletions, `{"messages":[]}`, `{"max_completion_tokens":50,"max_tokens":50,"messages":[]}`},
		{ChatCompletions, `{}`, `{"max_completion_tokens":50,"max_tokens":50}`},
		{ChatCompletions, `{"max_completion_tokens":4000}`, `{"max_tokens":50,"max_completion_tokens":50}`},
		{ChatCompletions, `{"max_completion_tokens":10}`, `{"max_tokens":50,"max_completion_tokens":10}`},
		{ChatCompletions, `{"max_tokens":10}`, `{"max_tokens":10}`},
		{ChatCompletions, `{"n_predict":10}`, `{"max_completion_tokens":50,"max_tokens":50,"n_predict":10}`},
		{Completions, `{"prompt":"x"}`, `{"max_tokens":50,"prompt":"x"}`},
		{AnthropicMessages, `{"messages":[]}`, `{"max_tokens":50,"messages":[]}`},
	} {
		r := jsonRequest(http.MethodPost, "application/json", tc.body)
		SetOutputCap(r, tc.api, 50, true)
		if got, _ := io.ReadAll(r.Body); string(got) != tc.want {
			t.Errorf("%s (%d): sent %s, want %s", tc.body, tc.api, got, tc.want)
		}
	}
}

// TestSetOutputCapRefused: a cap that is not positive changes nothing.
func TestSetOutputCapRefused(t *testing.T) {
	t.Parallel()
	for _, c := range []int64{0, -1} {
		r := jsonRequest(http.MethodPost, "application/json", `{"max_tokens":4000}`)
		if SetOutputCap(r, ChatCompletions, c, false) {
			t.Errorf("cap %d: the body changed", c)
		}
	}
}

// TestOutputCapAllocs: ReadBound on a body already parsed, and SetOutputCap on a body
// already within the cap, allocate nothing, for each API shape.
func TestOutputCapAllocs(t *testing.T) {
	for _, tc := range []struct {
		api  API
		body string
	}{
		{ChatCompletions, `{"model":"m","max_completion_tokens":50,"max_tokens":20,"n":2,"messages":[{"role":"user","content":"hello \"there\""}]}`},
		{Completions, `{"prompt":"hi","max_tokens":50,"best_of":2}`},
		{Responses, `{"input":"hi","max_output_tokens":50,"tools":[{"type":"function","name":"f"}]}`},
		{AnthropicMessages, `{"max_tokens":50,"tools":[{"name":"f"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`},
		{GeminiGenerate, `{"contents":[{"parts":[{"text":"hi"}]}],"generation_config":{"maxOutputTokens":50,"candidateCount":2}}`},
	} {
		r := jsonRequest(http.MethodPost, "application/json", tc.body)
		if b := ReadBound(r, tc.api); b.Cap != 50 {
			t.Fatalf("%d: cap %d", tc.api, b.Cap)
		}
		if n := testing.AllocsPerRun(100, func() { ReadBound(r, tc.api) }); n != 0 {
			t.Errorf("%d: ReadBound on a parsed body allocates %v times", tc.api, n)
		}
		if n := testing.AllocsPerRun(100, func() {
			if SetOutputCap(r, tc.api, 50, false) {
				t.Fatal("the body changed")
			}
		}); n != 0 {
			t.Errorf("%d: SetOutputCap within the cap allocates %v times", tc.api, n)
		}
	}
}

// jsonMembers returns every member of the JSON object raw, in order, duplicates included;
// ok is false when raw is not an object.
func jsonMembers(raw []byte) (names []string, values []json.RawMessage, ok bool) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, nil, false
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, nil, false
		}
		var v json.RawMessage
		if dec.Decode(&v) != nil {
			return nil, nil, false
		}
		names, values = append(names, t.(string)), append(values, v)
	}
	return names, values, true
}

// capSpellings are the names each API's upstream reads its output caps by, at the top level
// (GeminiGenerate: in generationConfig).
var capSpellings = map[API][]string{
	ChatCompletions:   {"max_completion_tokens", "max_tokens", "n_predict"},
	Completions:       {"max_tokens", "n_predict"},
	Responses:         {"max_output_tokens"},
	AnthropicMessages: {"max_tokens"},
	GeminiGenerate:    {"maxOutputTokens", "max_output_tokens"},
}

// checkCapsIn checks that every member of the object raw that a reader takes for one of
// names (exactly, or under case folding as Go's encoding/json does) is a positive integer of
// at most limit, and that one of them is there exactly.
func checkCapsIn(t *testing.T, raw []byte, names []string, limit int64) {
	t.Helper()
	ns, vs, ok := jsonMembers(raw)
	if !ok {
		t.Fatalf("not an object: %s", raw)
	}
	exact := false
	for i, n := range ns {
		for _, s := range names {
			if !strings.EqualFold(n, s) {
				continue
			}
			exact = exact || n == s
			if v, err := strconv.ParseInt(string(vs[i]), 10, 64); err != nil || v <= 0 || v > limit {
				t.Fatalf("%s is %s, not at most %d: %s", n, vs[i], limit, raw)
			}
		}
	}
	if !exact {
		t.Fatalf("no %v: %s", names, raw)
	}
}

// withoutCaps decodes the JSON object raw (the last of duplicates, as encoding/json reads
// them) without the members folded equal (foldName) to one of names.
func withoutCaps(raw []byte, names []string) map[string]any {
	var m map[string]any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	_ = dec.Decode(&m)
	for k := range m {
		var buf, sbuf [maxFolded]byte
		for _, s := range names {
			if f := foldName(&buf, []byte(k)); f != nil && string(f) == string(foldName(&sbuf, []byte(s))) {
				delete(m, k)
			}
		}
	}
	return m
}

// isObject reports whether raw is one JSON object that encoding/json decodes, with nothing
// after it.
func isObject(raw []byte) bool {
	var m map[string]json.RawMessage
	return json.Unmarshal(raw, &m) == nil && m != nil
}

// checkCapped checks what SetOutputCap(api, limit) made of before: after, a JSON object whose
// every cap member (GeminiGenerate: every generationConfig, each an object) is a positive
// integer of at most limit, with one of each level there, and which decodes to what before
// decodes to but for the cap members (and a generationConfig that was not an object).
func checkCapped(t *testing.T, api API, before, after []byte, limit int64) {
	t.Helper()
	if !isObject(before) {
		if !bytes.Equal(before, after) {
			t.Fatalf("a body that is not one JSON object changed: %q to %q", before, after)
		}
		return
	}
	if !isObject(after) {
		t.Fatalf("not a JSON object: %s (from %s)", after, before)
	}
	caps := capSpellings[api]
	if api != GeminiGenerate {
		checkCapsIn(t, after, caps, limit)
		if old, now := withoutCaps(before, caps), withoutCaps(after, caps); !reflect.DeepEqual(old, now) {
			t.Fatalf("more than the caps changed: %v to %v", old, now)
		}
		return
	}
	configs := []string{"generationConfig", "generation_config"}
	ns, vs, _ := jsonMembers(after)
	exact := false
	for i, n := range ns {
		if strings.EqualFold(n, configs[0]) || strings.EqualFold(n, configs[1]) {
			exact = exact || n == configs[0] || n == configs[1]
			checkCapsIn(t, vs[i], caps, limit)
		}
	}
	if !exact {
		t.Fatalf("no generationConfig: %s", after)
	}
	old, now := withoutCaps(before, configs), withoutCaps(after, configs)
	if !reflect.DeepEqual(old, now) {
		t.Fatalf("more than the config changed: %v to %v", old, now)
	}
	oldConfigs, newConfigs := configMembers(before), configMembers(after)
	for k, c := range oldConfigs {
		if _, ok := c.(map[string]any); !ok {
			continue // not an object: replaced whole
		}
		if o, n := withoutCaps(jsonOf(c), caps), withoutCaps(jsonOf(newConfigs[k]), caps); !reflect.DeepEqual(o, n) {
			t.Fatalf("more than the cap of %s changed: %v to %v", k, o, n)
		}
	}
}

// configMembers decodes the top-level members of the JSON object raw folded equal to
// generationConfig.
func configMembers(raw []byte) map[string]any {
	var m map[string]any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	_ = dec.Decode(&m)
	out := map[string]any{}
	var buf [maxFolded]byte
	for k, v := range m {
		if f := foldName(&buf, []byte(k)); string(f) == "generationconfig" {
			out[k] = v
		}
	}
	return out
}

// jsonOf encodes v.
func jsonOf(v any) []byte {
	b, _ := json.Marshal(v)
	return b
}

// FuzzSetOutputCap: for any body, API and cap, SetOutputCap never panics; a body that is not
// one JSON object goes on as it came; another goes on as a JSON object whose every cap member
// is a positive integer of at most the cap, with the rest unchanged (checkCapped); it reports
// whether it changed the body, and sets the length to the body's.
func FuzzSetOutputCap(f *testing.F) {
	for _, tc := range capCases {
		f.Add([]byte(tc.body), uint8(tc.api), int64(50))
	}
	for _, tc := range unreadableCases[:5] {
		f.Add([]byte(tc.body), uint8(ChatCompletions), int64(1))
	}
	f.Fuzz(func(t *testing.T, body []byte, api uint8, limit int64) {
		a := API(api % 7)
		limit = limit&(1<<40-1) + 1
		r := jsonRequest(http.MethodPost, "application/json", string(body))
		bd := ReadBound(r, a)
		changed := SetOutputCap(r, a, limit, limit%2 == 0)
		after, _ := io.ReadAll(r.Body)
		if changed == bytes.Equal(after, body) || r.ContentLength != int64(len(after)) {
			t.Fatalf("reports %v; %q became %q (length %d)", changed, body, after, r.ContentLength)
		}
		if !bd.Readable || a == 0 || a == Embeddings {
			if changed {
				t.Fatalf("changed a body it does not cap: %q to %q", body, after)
			}
			return
		}
		checkCapped(t, a, body, after, limit)
	})
}

// BenchmarkReadBound reads the bound of a 20 KB chat completions body: "fresh" reads and
// parses the body as the first reader of a request does; "parsed" reads a body that Model
// has parsed already.
func BenchmarkReadBound(b *testing.B) {
	var sb strings.Builder
	sb.WriteString(`{"model":"gpt-4o","max_completion_tokens":1000,"stream":true,"messages":[`)
	for i := 0; sb.Len() < 20_000; i++ {
		if i > 0 {
			sb.WriteByte(',')
		}
		sb.WriteString(`{"role":"user","content":"` + strings.Repeat("The quick brown fox jumps over the lazy dog. ", 8) + `\"quoted\"\n"}`)
	}
	sb.WriteString(`]}`)
	body := []byte(sb.String())
	r := jsonRequest(http.MethodPost, "application/json", "")
	b.Run("fresh", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(body)))
		for b.Loop() {
			r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
			if bd := ReadBound(r, ChatCompletions); bd.Cap != 1000 || bd.Unbounded {
				b.Fatalf("%+v", bd)
			}
		}
	})
	b.Run("parsed", func(b *testing.B) {
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		_, _ = Model(r)
		b.ReportAllocs()
		b.SetBytes(int64(len(body)))
		for b.Loop() {
			if bd := ReadBound(r, ChatCompletions); bd.Cap != 1000 || bd.Unbounded {
				b.Fatalf("%+v", bd)
			}
		}
	})
}

// TestFieldsFolded: each cap, choices and config field's folded name is what its spellings
// fold to.
func TestFieldsFolded(t *testing.T) {
	t.Parallel()
	var fields []field
	for _, lv := range append(topLevel[:], geminiConfig) {
		fields = append(append(fields, lv.caps...), lv.choices...)
	}
	for _, fd := range append(fields, geminiTop...) {
		for _, s := range fd.spellings {
			var buf [maxFolded]byte
			if f := foldName(&buf, []byte(s)); string(f) != fd.folded {
				t.Errorf("%s folds to %q, not %q", s, f, fd.folded)
			}
		}
	}
}

// TestReadBoundAgain: asked again, ReadBound gives the same bound without allocating; after
// SetOutputCap it reads the body that was written, not the bound it gave before.
func TestReadBoundAgain(t *testing.T) {
	r := jsonRequest(http.MethodPost, "application/json", `{"model":"m","max_tokens":4000,"messages":[]}`)
	first := ReadBound(r, ChatCompletions)
	if n := testing.AllocsPerRun(10, func() { ReadBound(r, ChatCompletions) }); n != 0 || first.Cap != 4000 {
		t.Fatalf("cap %d, %v allocations again; want 4000 and 0", first.Cap, n)
	}
	if !SetOutputCap(r, ChatCompletions, 100, false) {
		t.Fatal("SetOutputCap changed nothing")
	}
	if b := ReadBound(r, ChatCompletions); b.Cap != 100 {
		t.Fatalf("after SetOutputCap: cap %d, want 100", b.Cap)
	}
}
