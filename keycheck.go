package ratelimitredis

import (
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

// checkPlaceholders expands the Caddyfile's placeholder shorthands in the zone's key and cost
// (provisionNumbers does the same for its numbers),
// and logs a warning for each placeholder of them that cannot have a value where the handler
// runs: a shorthand written in JSON (expanded), an {http.auth.*} placeholder (set by
// authentication, which the Caddyfile orders after this handler), a name of Caddy's
// {http.request.*} namespace that Caddy does not provide. A key whose placeholders are all empty
// gets the zone's empty_key; the warnings say so. A zone with block and empty_key shared whose key
// can be empty (no candidate is the client's IP) gets a warning too: one keyless client's block
// is every keyless client's.
func (z *Zone) checkPlaceholders(logger *zap.Logger) {
	emptyKey := zap.String("empty_key", z.EmptyKey)
	for i, k := range z.Key {
		z.Key[i] = z.checkPlaceholder(logger, "key", k, emptyKey)
	}
	z.Cost = z.checkPlaceholder(logger, "cost", z.Cost, emptyKey)
	if z.Block > 0 && z.EmptyKey == EmptyKeyShared && slices.ContainsFunc(z.Key, hasPlaceholder) && !slices.ContainsFunc(z.Key, ipCandidate) {
		logger.Warn("a zone with block and empty_key shared: every request whose key placeholders are all empty shares one "+
			"client key, so one such client's denial blocks them all; give the key a last candidate of {client_ip}, or "+
			"empty_key skip or deny", zap.String("zone", z.Name), zap.Strings("key", z.Key))
	}
}

// checkPlaceholder expands and checks the placeholders of value, the zone's field, and returns
// it expanded. whenEmpty says, in the warnings, what an empty value does.
func (z *Zone) checkPlaceholder(logger *zap.Logger, field, value string, whenEmpty zap.Field) string {
	if expanded := expandShorthands(value); expanded != value {
		logger.Warn("a "+field+" placeholder is Caddyfile shorthand, which Caddy does not expand in JSON; "+
			"it is read as the Caddyfile would read it: write that in JSON",
			zap.String("zone", z.Name), zap.String(field, value), zap.String("read_as", expanded))
		value = expanded
	}
	for _, name := range placeholderNames(value) {
		switch why, hint := placeholderProblem(name); why {
		case "":
		case "auth":
			logger.Warn("a "+field+" placeholder is set by authentication (basic_auth, or an authentication plugin) and is empty "+
				"before it: the Caddyfile orders rate_limit_redis before basic_auth, so unless this handler is placed in a "+
				"route after the authentication (route { basic_auth … ; rate_limit_redis … }) every request has it empty "+
				"and gets what an empty value gets; ignore this warning if the handler runs after authentication",
				zap.String("zone", z.Name), zap.String("placeholder", "{"+name+"}"), whenEmpty)
		default:
			fields := []zap.Field{zap.String("zone", z.Name), zap.String("placeholder", "{"+name+"}"), whenEmpty}
			if hint != "" {
				fields = append(fields, zap.String("did_you_mean", hint))
			}
			logger.Warn("a "+field+" placeholder is not one Caddy provides: it is always empty", fields...)
		}
	}
	return value
}

// shorthands is the Caddyfile adapter's own replacer of placeholder shorthands.
var shorthands = httpcaddyfile.NewShorthandReplacer()

// expandShorthands replaces the Caddyfile's placeholder shorthands in s ({client_ip},
// {header.X-API-Key}, {remote_host}, …) by the placeholders they stand for, with the Caddyfile
// adapter's own replacer, so that the JSON means what the same text means in a Caddyfile. It
// leaves full placeholder names alone, so a config adapted from a Caddyfile is unchanged, and
// {file.*}, which in JSON is Caddy's own placeholder of a file's contents.
func expandShorthands(s string) string {
	if !strings.Contains(s, "{") {
		return s
	}
	const hidden = "\x00file."
	seg := caddyfile.Segment{{Text: strings.ReplaceAll(s, "{file.", hidden)}}
	shorthands.ApplyToSegment(&seg)
	return strings.ReplaceAll(seg[0].Text, hidden, "{file.")
}

// placeholderNames returns the names of the placeholders in s, without their braces; an
// escaped brace (\{) opens none.
func placeholderNames(s string) []string {
	var names []string
	for i := 0; i < len(s); i++ {
		if s[i] != '{' || (i > 0 && s[i-1] == '\\') {
			continue
		}
		end := strings.IndexByte(s[i+1:], '}')
		if end < 0 {
			break
		}
		if name := s[i+1 : i+1+end]; name != "" {
			names = append(names, name)
		}
		i += end + 1
	}
	return names
}

// placeholderProblem says why the placeholder name can have no value when this handler decides
// a request: "auth" for {http.auth.*}, "unknown" for a name in Caddy's own {http.request.*}
// namespace that Caddy v2.11 does not provide, or in the handler's own namespace other than the
// request's model (the others are set once the request is decided), with a hint of what was
// probably meant; or "" when it may have one. Placeholders of other namespaces ({http.vars.*} of
// `vars` and `map`, {env.*}, a plugin's, the outputs of `map`) are not judged: Caddy cannot tell
// which are set.
func placeholderProblem(name string) (why, hint string) {
	if strings.HasPrefix(name, "http.auth.") {
		return "auth", ""
	}
	if strings.HasPrefix(name, placeholderPrefix) && name != modelPlaceholder {
		if strings.Contains(name, "model") {
			hint = "{" + modelPlaceholder + "}"
		}
		return "unknown", hint
	}
	rest, ok := strings.CutPrefix(name, "http.request.")
	if !ok || knownRequestPlaceholder(rest) {
		return "", ""
	}
	switch {
	case strings.Contains(rest, "client_ip"), strings.Contains(rest, "remote_ip"), strings.Contains(rest, "remote.ip"):
		hint = "{http.vars.client_ip}"
	case strings.HasPrefix(rest, "headers."):
		hint = "{http.request.header." + strings.TrimPrefix(rest, "headers.") + "}"
	case strings.HasPrefix(rest, "cookies."):
		hint = "{http.request.cookie." + strings.TrimPrefix(rest, "cookies.") + "}"
	}
	return "unknown", hint
}

// requestPlaceholders are the names under http.request. that Caddy v2.11's HTTP replacer
// provides as they are (modules/caddyhttp/replacer.go).
var requestPlaceholders = map[string]bool{
	"method": true, "scheme": true, "proto": true, "proto_name": true, "host": true, "port": true,
	"hostport": true, "local": true, "local.host": true, "local.port": true, "remote": true,
	"remote.host": true, "remote.port": true, "uri": true, "uri_escaped": true, "uri.path": true,
	"uri.path_escaped": true, "uri.path.file": true, "uri.path.dir": true, "uri.path.file.base": true,
	"uri.path.file.ext": true, "uri.query": true, "uri.query_escaped": true, "uri.prefixed_query": true,
	"duration": true, "duration_ms": true, "uuid": true, "body": true, "body_base64": true,
	"orig_method": true, "orig_uri": true, "orig_uri.path": true, "orig_uri.path.file": true,
	"orig_uri.path.file_escaped": true, "orig_uri.path.dir": true, "orig_uri.query": true,
	"orig_uri.prefixed_query": true,
}

// knownRequestPlaceholder reports whether http.request.<rest> is a placeholder Caddy v2.11
// provides: one of requestPlaceholders, or a name of its families (header.<field>,
// cookie.<name>, uri.query.<param>, tls.…, remote.host/<bits>, host.labels.<n>,
// uri.path.<n>, orig_uri.path.<n>).
func knownRequestPlaceholder(rest string) bool {
	if requestPlaceholders[rest] {
		return true
	}
	for _, family := range []string{"header.", "cookie.", "uri.query.", "tls.", "remote.host/"} {
		if strings.HasPrefix(rest, family) && len(rest) > len(family) {
			return true
		}
	}
	for _, family := range []string{"host.labels.", "uri.path.", "orig_uri.path."} {
		if n, ok := strings.CutPrefix(rest, family); ok {
			if i, err := strconv.Atoi(n); err == nil && i >= 0 {
				return true
			}
		}
	}
	return false
}

// hasPlaceholder reports whether s holds something of the form {…}.
func hasPlaceholder(s string) bool {
	open := strings.IndexByte(s, '{')
	return open >= 0 && strings.IndexByte(s[open:], '}') > 1
}
