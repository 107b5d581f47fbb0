// Package limiter decides rate limits in Redis, for every instance of a deployment at once.
//
// A request is decided against all the zones that apply to it by one atomic Lua script call
// (lua/decide.lua, run by EVALSHA): admitted iff every zone admits it, and then every zone is
// charged; otherwise none is. A zone is one of six algorithms (Zone, Algorithm): a token bucket
// (which may hold a request for its turn: MaxWait), a sliding window log, a fixed window of a
// duration or a calendar period, a sliding window counter, a concurrency limit of requests in
// flight, and an adaptive concurrency limit learnt from the latency its requests report
// (Adaptive).
//
// Limiter.Decide is the decision. Before it calls Redis it spends the tokens this instance was
// granted ahead (Lease: a hot client's requests decided in process, from tokens Redis charged
// when it granted them) and gives again the denials it remembers (the deny cache), and it asks
// the caller's Gate (a circuit breaker). Concurrent decisions share round trips and script calls
// (Batcher). On Redis Cluster, a request whose zones fall in several hash slots is decided by
// one call per slot and committed or released after (lua/settle.lua).
//
// A zone's charge may be held and settled after the response (Request.Hold, Limiter.Settle:
// charged by the response's status or by what it reports, such as its tokens). A concurrency
// zone's slot is such a hold, kept alive while its request runs (Limiter.Refresh) and given back
// when it ends, or, when that failed, later (lost slots).
//
// Besides: the state of a client in a zone (Limiter.State, Limiter.InFlight) and its reset
// (Limiter.Reset, announced to the other instances: ResetListener); the in-process decisions of
// fail_mode local (Local); the client keys and their Redis keys (CandidateKey, ClientKey,
// KeySecret, StateKey). The package imports nothing from Caddy.
package limiter
