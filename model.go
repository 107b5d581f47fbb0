package ratelimitredis

import (
	"net/http"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// modelPlaceholder is the request's model, read from its JSON body (usage.Model: "" when the
// body names no model, "?unreadable" when it is not JSON, over 1 MiB or compressed; a body
// whose model upstreams read apart, "Model" beside "model" or a model that is not a string,
// is refused with 400 by a zone that uses the placeholder), so that a zone can
// key on it (a budget per user and model), take its numbers or cost from it (through a map of
// it), or match it. The body is read before the decision only for a zone that uses the
// placeholder, once per request, and only when the zone's other matchers have matched: in its
// key, cost or numbers, once its matchers have matched; in a matcher, once the other matchers of
// the set have. A request the module reads the body of anyway (a zone charging openai_usage
// asks a stream for its usage) has it too, for the later handlers and the logs.
const modelPlaceholder = placeholderPrefix + "request.model"

// modelTag is the model placeholder as configurations write it.
const modelTag = "{" + modelPlaceholder + "}"

// usesModel reports whether the zone uses the model placeholder in its key, cost or numbers, or
// has a charge weight from a placeholder (which a map of the model may give: the model is read
// before it is resolved).
func (z *Zone) usesModelPlaceholder() bool {
	if z.Charge != nil && z.Charge.Weights != nil && z.Charge.Weights.dynamic() {
		return true
	}
	texts := append([]string{z.Cost}, z.Key...)
	for f := range numFields {
		texts = append(texts, z.number(f).text)
	}
	return slices.ContainsFunc(texts, func(s string) bool { return strings.Contains(s, modelTag) })
}

// modelMatcherNames returns, per matcher set of the zone, the names of its matchers whose JSON
// names the model placeholder; nil when none does. Call it before the matchers are loaded,
// which drops their JSON.
func (z *Zone) modelMatcherNames() []map[string]bool {
	var names []map[string]bool
	for i, set := range z.MatcherSetsRaw {
		for name, raw := range set {
			if strings.Contains(string(raw), modelTag) {
				if names == nil {
					names = make([]map[string]bool, len(z.MatcherSetsRaw))
				}
				if names[i] == nil {
					names[i] = map[string]bool{}
				}
				names[i][name] = true
			}
		}
	}
	return names
}

// loadMatchers sets the zone's matcher sets from mods, its matchers as LoadModule loaded them
// (one map per set, by name): with modelNames (modelMatcherNames), each set's matchers that use
// the model go to modelMatchers, to run once the others of their set have matched.
func (z *Zone) loadMatchers(mods any, modelNames []map[string]bool) error {
	sets := mods.([]map[string]any)
	if modelNames == nil {
		return z.matcherSets.FromInterface(sets)
	}
	plain, model := make([]map[string]any, len(sets)), make([]map[string]any, len(sets))
	for i, set := range sets {
		plain[i], model[i] = map[string]any{}, map[string]any{}
		for name, m := range set {
			if modelNames[i][name] {
				model[i][name] = m
			} else {
				plain[i][name] = m
			}
		}
	}
	if err := z.matcherSets.FromInterface(plain); err != nil {
		return err
	}
	return z.modelMatchers.FromInterface(model)
}

// matches reports whether r matches one of the zone's matcher sets (it has some): a set's
// matchers that do not use the model first, then, if they matched, the model is published
// (*read: it is already) and the set's matchers that use it run.
func (z *Zone) matches(r *http.Request, repl *caddy.Replacer, read *bool) (bool, error) {
	if z.modelMatchers == nil {
		return z.matcherSets.AnyMatchWithError(r)
	}
	for i, set := range z.matcherSets {
		match, err := set.MatchWithError(r)
		if err == nil && match && len(z.modelMatchers[i]) > 0 {
			if err := readModel(r, repl, true, read); err != nil {
				return false, err
			}
			match, err = z.modelMatchers[i].MatchWithError(r)
		}
		if err != nil || match {
			return match, err
		}
	}
	return false, nil
}

// readModel publishes r's model as the model placeholder when needed and not published yet
// (*read); r's body is then read, once. The error is the usage.Refusal of a body whose model
// upstreams read apart, every time it is asked.
func readModel(r *http.Request, repl *caddy.Replacer, needed bool, read *bool) error {
	if !needed {
		return nil
	}
	if *read {
		if _, err := usage.Model(r); err != nil {
			return err // parsed once: the same answer
		}
		return nil
	}
	*read = true
	return publishModel(r, repl)
}

// publishModel sets the model placeholder to r's model, reading r's body if it was not read,
// and returns the usage.Refusal of a body whose model upstreams read apart (the placeholder is
// then "?unreadable").
func publishModel(r *http.Request, repl *caddy.Replacer) error {
	m, err := usage.Model(r)
	repl.Set(modelPlaceholder, m)
	return err
}
