package limiter_test

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// zoneOption is one option a zone can have, as the combination test puts it on a zone. Every
// field of Zone and Request is either one of zoneNumbers or set by exactly one zoneOption
// (TestZoneOptionsDeclared), so a new option joins the combinations by being declared here.
type zoneOption struct {
	// name is the option's name in the Caddyfile.
	name string
	// fields are the Zone and Request fields the option sets.
	fields []string
	// algorithms are those the option applies to; nil: every one. Zone.Validate still has the
	// last word on a zone that combines options.
	algorithms []limiter.Algorithm
	// set puts the option on z, and on r, a request of z.
	set func(z *limiter.Zone, r *limiter.Request)
	// prepare runs once before the requests of a combination: what an operator does beforehand.
	prepare func(l *limiter.Limiter, z *limiter.Zone, key string) error
	// quota is the zone's quota in force with the option; nil: the zone's own.
	quota func(z *limiter.Zone) int64
	// warm is the number of requests the client sends to the zone alone beforehand.
	warm int
}

// zoneNumbers are the fields of Zone and Request that are a zone's numbers, identity or
// outcome rather than an option.
var zoneNumbers = []string{
	"Zone.Name", "Zone.Algorithm", "Zone.Capacity", "Zone.RefillRate", "Zone.Limit", "Zone.Window",
	"Zone.Period", "Zone.Location", "Zone.MaxCost", "Zone.Adaptive",
	"Request.Zone", "Request.Key", "Request.Cost", "Request.Result", "Request.Tag",
}

// zoneOptions are the options the combination test combines: each on its own, and every pair.
var zoneOptions = []zoneOption{
	{name: "none"},
	{
		name: "block", fields: []string{"Zone.Block", "Zone.BlockMax"},
		set: func(z *limiter.Zone, _ *limiter.Request) { z.Block, z.BlockMax = time.Hour, 2*time.Hour },
	},
	{
		// A lease zone's quota is far above the other's, so that the grants it hands out are
		// never what limits the request; its client is hot (warmed up alone) so that the
		// combined requests ask for grants.
		name: "lease", fields: []string{"Zone.Lease"}, warm: 20,
		algorithms: []limiter.Algorithm{limiter.TokenBucket, limiter.FixedWindow},
		set: func(z *limiter.Zone, _ *limiter.Request) {
			if z.Algorithm == limiter.TokenBucket {
				z.Capacity = 1000
			} else {
				z.Limit = 1000
			}
			z.Lease = &limiter.Lease{Max: 10, TTL: 10 * time.Second}
		},
	},
	{
		name: "overrides", fields: []string{"Zone.Overrides"},
		set: func(z *limiter.Zone, _ *limiter.Request) { z.Overrides = true },
		prepare: func(l *limiter.Limiter, z *limiter.Zone, key string) error {
			o := limiter.Override{Limit: z.Quota() - 1}
			if z.Algorithm == limiter.TokenBucket {
				o = limiter.Override{Capacity: z.Quota() - 1}
			}
			return l.SetOverride(context.Background(), z, key, o, time.Hour)
		},
		quota: func(z *limiter.Zone) int64 { return z.Quota() - 1 },
	},
	{
		name: "dry_run", fields: []string{"Zone.Shadow"},
		set:   func(z *limiter.Zone, _ *limiter.Request) { z.Shadow = true },
		quota: func(*limiter.Zone) int64 { return -1 }, // never limits the request
	},
	{
		// count_status and charge: the charge is held at admission and settled after the
		// response (Limiter.Settle, with the request's cost).
		name: "charge", fields: []string{"Request.Hold"},
		set: func(_ *limiter.Zone, r *limiter.Request) { r.Hold = time.Minute },
	},
	{
		// A token bucket shapes; a concurrency zone queues: its denial is where the caller
		// would wait (Enqueue), and a request decided afresh never overtakes a waiter.
		name: "max_wait", fields: []string{"Zone.MaxWait", "Request.NoWait"},
		algorithms: []limiter.Algorithm{limiter.TokenBucket, limiter.Concurrency, limiter.AdaptiveConcurrency},
		set:        func(z *limiter.Zone, _ *limiter.Request) { z.MaxWait = time.Second },
	},
	{
		// A concurrency zone or token bucket with classes queues: its denial is where the
		// caller would wait (Enqueue).
		name: "priority", fields: []string{"Zone.Classes", "Request.Class"},
		algorithms: []limiter.Algorithm{limiter.TokenBucket, limiter.Concurrency, limiter.AdaptiveConcurrency},
		set: func(z *limiter.Zone, r *limiter.Request) {
			z.MaxWait, z.Classes, r.Class = time.Second, []int{0, 200}, 1
		},
	},
	{
		// A queue of waiters that take turns by tenant: its denial is where the caller would
		// wait (Enqueue), as with max_wait; a token bucket queues only with classes.
		name: "fair_by", fields: []string{"Zone.FairTenants", "Request.Tenant"},
		algorithms: []limiter.Algorithm{limiter.TokenBucket, limiter.Concurrency, limiter.AdaptiveConcurrency},
		set: func(z *limiter.Zone, r *limiter.Request) {
			z.MaxWait, z.FairTenants, r.Tenant = time.Second, 10, "tenant-a"
			if z.Algorithm == limiter.TokenBucket && len(z.Classes) == 0 {
				z.Classes = []int{0}
			}
		},
	},
	{
		// Counted in the zone's top in the same call; the decision is the zone's without it.
		name: "top", fields: []string{"Zone.Top", "Zone.TopWindow"},
		set: func(z *limiter.Zone, _ *limiter.Request) { z.Top, z.TopWindow = 4, time.Minute },
	},
	{
		// Reported crossings change nothing the zone decides.
		name: "near_limit", fields: []string{"Zone.NearLimit"},
		set: func(z *limiter.Zone, _ *limiter.Request) { z.NearLimit = 0.5 },
	},
	{
		// The request asks for up to far more than any quota: its first admission takes all the
		// zone holds, so the client is admitted once (settled to what it reserved). Last in this
		// list, so that its quota is the one in force when it shares a zone with another option.
		name: "cap_output", fields: []string{"Zone.UpTo"},
		algorithms: []limiter.Algorithm{limiter.TokenBucket, limiter.FixedWindow},
		set: func(z *limiter.Zone, r *limiter.Request) {
			z.UpTo = true
			r.SetUpTo(1000)
		},
		quota: func(*limiter.Zone) int64 { return 1 },
	},
}

// applies returns the algorithms o applies to.
func (o zoneOption) applies() []limiter.Algorithm {
	if o.algorithms == nil {
		return allAlgorithms
	}
	return o.algorithms
}

// algorithmZone returns a zone of algorithm a named name with a quota of q and no refill or
// window end within the test.
func algorithmZone(name string, a limiter.Algorithm, q int64) *limiter.Zone {
	z := &limiter.Zone{Name: name, Algorithm: a}
	switch {
	case a.QuotaIsCapacity():
		z.Capacity, z.RefillRate = q, 1.0/3600
	case a.HoldsSlots():
		z.Limit = q
		if a.Adapts() { // its limit in force the quota: its floor and its ceiling
			ad := limiter.Adaptive{MinLimit: q}.WithDefaults(q)
			z.Adaptive = &ad
		}
	default:
		z.Limit, z.Window = q, time.Hour
	}
	return z
}

// allAlgorithms are every algorithm of the table: a new one is in the pair test at once.
var allAlgorithms = limiter.EveryAlgorithm()

// combinationZone is one zone of a combination: its algorithm, its options and its quota.
type combinationZone struct {
	alg     limiter.Algorithm
	options []zoneOption
	quota   int64
}

// build returns the zone and a request of it for key, with its options set; nil when the
// options do not apply to the algorithm or Zone.Validate refuses them together.
func (c combinationZone) build(name, key string) (*limiter.Zone, limiter.Request) {
	z := algorithmZone(name, c.alg, c.quota)
	r := limiter.Request{Zone: z, Key: key, Cost: 1}
	for _, o := range c.options {
		if o.algorithms != nil && !slices.Contains(o.algorithms, c.alg) {
			return nil, r
		}
		if o.set != nil {
			o.set(z, &r)
		}
	}
	if c.alg.HoldsSlots() {
		r.Hold = time.Minute // a concurrency zone's slot is held while its request runs
	}
	if z.Validate() != nil {
		return nil, r
	}
	return z, r
}

// combination is two zones on one request.
type combination struct {
	name string
	a, b combinationZone
}

// combinations returns every pair of options (one option per zone, and both on one zone beside
// a zone with none), each with every algorithm the first option applies to for the first zone
// and, in turn, one the second applies to for the second.
func combinations() []combination {
	var out []combination
	for i, x := range zoneOptions {
		for j, y := range zoneOptions[i:] {
			for k, a := range x.applies() {
				ys := y.applies()
				b := ys[(k+i+j+1)%len(ys)]
				out = append(out,
					combination{
						name: fmt.Sprintf("%s-%s/%s+%s", x.name, y.name, a, b),
						a:    combinationZone{alg: a, options: []zoneOption{x}, quota: 3},
						b:    combinationZone{alg: b, options: []zoneOption{y}, quota: 5},
					},
					combination{
						name: fmt.Sprintf("%s+%s/%s", x.name, y.name, a),
						a:    combinationZone{alg: a, options: []zoneOption{x, y}, quota: 3},
						b:    combinationZone{alg: b, options: []zoneOption{zoneOptions[0]}, quota: 5},
					})
			}
		}
	}
	return out
}

// TestZoneOptionsDeclared: every field of Zone and Request is a number or an option of the
// combination test, so that an option added to the limiter is combined with every other.
func TestZoneOptionsDeclared(t *testing.T) {
	t.Parallel()
	declared := map[string]bool{}
	for _, f := range zoneNumbers {
		declared[f] = true
	}
	for _, o := range zoneOptions {
		for _, f := range o.fields {
			if declared[f] {
				t.Errorf("%s is declared twice (option %s)", f, o.name)
			}
			declared[f] = true
		}
	}
	for _, typ := range []reflect.Type{reflect.TypeFor[limiter.Zone](), reflect.TypeFor[limiter.Request]()} {
		for f := range typ.Fields() {
			name := typ.Name() + "." + f.Name
			if f.IsExported() && !declared[name] {
				t.Errorf("%s is neither a zone number nor an option of zoneOptions: declare it there, so that the combination test combines it with every other option", name)
			}
			delete(declared, name)
		}
	}
	for f := range declared {
		t.Errorf("%s is declared but is no field of Zone or Request", f)
	}
}

// TestZoneOptionCombinations: every pair of zone options, on two zones of one request or
// together on one zone, with every algorithm, decides as each option does alone: no decision
// fails (an error is a 503 with fail_mode closed and no limit with open), and the client is
// admitted exactly as many times as its tightest enforced zone allows, then refused. On one
// Redis server, and on a 3-primary Redis Cluster with both zones in one hash slot and in two.
func TestZoneOptionCombinations(t *testing.T) {
	t.Parallel()
	cases := combinations()
	t.Run("standalone", func(t *testing.T) {
		t.Parallel()
		srv := redistest.Start(t)
		l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Leases: true})
		runCombinations(t, l, cases, func(i int) (string, string) { k := fmt.Sprint("c", i); return k, k })
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		c := redistest.StartCluster(t, 3)
		l := clusterLimiter(t, c, limiter.Options{Leases: true})
		t.Run("one slot", func(t *testing.T) {
			runCombinations(t, l, cases, func(i int) (string, string) { k := fmt.Sprint("s", i); return k, k })
		})
		t.Run("two slots", func(t *testing.T) {
			nodes := clientsOn(t, c, len(cases))
			runCombinations(t, l, cases, func(i int) (string, string) { return nodes[0][i], nodes[1][i] })
		})
	})
}

// runCombinations decides each combination of cases for the client keys keys(i) gives (one
// per zone) and checks it; it reports how many combinations ran and how many Zone.Validate
// refused.
func runCombinations(t *testing.T, l *limiter.Limiter, cases []combination, keys func(i int) (string, string)) {
	ctx := context.Background()
	t.Cleanup(func() { _ = l.ReturnLeases(ctx) })
	ran, invalid := 0, 0
	for i, c := range cases {
		ka, kb := keys(i)
		za, ra := c.a.build("a", ka)
		zb, rb := c.b.build("b", kb)
		if za == nil || zb == nil {
			invalid++
			if testing.Verbose() && strings.Contains(t.Name(), "standalone") {
				t.Log("refused:", c.name)
			}
			continue
		}
		ran++
		if err := decideCombination(l, c, za, zb, ra, rb); err != nil {
			t.Errorf("%s (keys %s, %s): %v", c.name, ka, kb, err)
		}
	}
	t.Logf("%d combinations decided, %d refused by Zone.Validate", ran, invalid)
	if ran == 0 {
		t.Fatal("no combination ran")
	}
}

// decideCombination sends one client's requests through zones za and zb (requests ra and rb)
// one at a time, and returns what went wrong: a failed decision, or a count of admitted
// requests other than the tightest enforced zone's quota.
func decideCombination(l *limiter.Limiter, c combination, za, zb *limiter.Zone, ra, rb limiter.Request) error {
	ctx := context.Background()
	enforced := int64(-1)
	for k, side := range []struct {
		zone *limiter.Zone
		req  limiter.Request
		cz   combinationZone
	}{{za, ra, c.a}, {zb, rb, c.b}} {
		q := side.zone.Quota()
		for _, o := range side.cz.options {
			if o.prepare != nil {
				if err := o.prepare(l, side.zone, side.req.Key); err != nil {
					return fmt.Errorf("zone %d, %s: %w", k, o.name, err)
				}
			}
			if o.quota != nil {
				q = o.quota(side.zone)
			}
			for range o.warm {
				r := side.req
				r.Result = limiter.Result{}
				d, err := l.Decide(ctx, []limiter.Request{r})
				if err != nil || !d.Allowed {
					return fmt.Errorf("zone %d warm-up, %s: %+v, %v", k, o.name, d, err)
				}
			}
		}
		if q >= 0 && (enforced < 0 || q < enforced) {
			enforced = q
		}
	}
	settle := ra.Hold > 0 && !za.Algorithm.HoldsSlots() && !zb.Algorithm.HoldsSlots() ||
		rb.Hold > 0 && !za.Algorithm.HoldsSlots() && !zb.Algorithm.HoldsSlots()
	n := int64(8)
	admitted := int64(0)
	for i := range n {
		reqs := []limiter.Request{ra, rb}
		d, err := l.Decide(ctx, reqs)
		if err != nil {
			return fmt.Errorf("request %d: %v", i+1, err)
		}
		if d.Err != nil {
			return fmt.Errorf("request %d: a hash slot failed: %v", i+1, d.Err)
		}
		if !d.Allowed {
			continue
		}
		admitted++
		if settle {
			// Each zone is charged what it reserved: its cost, or what a bound granted.
			amounts := []int64{max(reqs[0].Cost, int64(reqs[0].Result.Granted)), max(reqs[1].Cost, int64(reqs[1].Result.Granted))}
			if _, err := l.Settle(ctx, d.Held, amounts); err != nil {
				return fmt.Errorf("request %d: Settle: %v", i+1, err)
			}
		}
	}
	if enforced < 0 {
		enforced = n
	}
	if want := min(enforced, n); admitted != want {
		return fmt.Errorf("%d of %d admitted, want %d", admitted, n, want)
	}
	return nil
}
