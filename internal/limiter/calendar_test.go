package limiter_test

import (
	"archive/zip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestCalendarWindowsInEveryZone walks every clock change from 2020 to 2030 in every location of
// Go's time zone database, and checks each calendar period's windows around it: the window
// holds the instant it is computed for, has a positive length, and the next window starts
// where it ends.
func TestCalendarWindowsInEveryZone(t *testing.T) {
	names := zoneNames(t)
	from, until := time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2031, 1, 1, 0, 0, 0, 0, time.UTC)
	offsets := []time.Duration{-25 * time.Hour, -time.Hour, -30 * time.Minute, -time.Microsecond, 0,
		time.Microsecond, 30 * time.Minute, time.Hour, 25 * time.Hour}
	changes := 0
	for _, name := range names {
		loc, err := time.LoadLocation(name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for u := from; u.Before(until); {
			_, end := u.In(loc).ZoneBounds()
			if end.IsZero() || !end.Before(until) {
				break
			}
			changes++
			for _, p := range []limiter.Period{limiter.Hour, limiter.Day, limiter.Week, limiter.Month} {
				z := fw("z", 1, p, loc)
				for _, o := range offsets {
					checkWindow(t, z, end.Add(o))
				}
			}
			u = end
		}
	}
	if len(names) < 300 || changes < 1000 {
		t.Fatalf("walked %d locations and %d changes: the database was not read", len(names), changes)
	}
	t.Logf("%d locations, %d clock changes", len(names), changes)
}

// checkWindow checks the window of z that holds at, and that its neighbours meet it.
func checkWindow(t *testing.T, z *limiter.Zone, at time.Time) {
	t.Helper()
	start, end := z.WindowAt(at)
	if at.Before(start) || !at.Before(end) {
		t.Fatalf("%v %s at %s: [%s, %s) does not hold it", z.Location, z.Period, at.In(z.Location), start.In(z.Location), end.In(z.Location))
	}
	if nextStart, nextEnd := z.WindowAt(end); !nextStart.Equal(end) || !nextEnd.After(nextStart) {
		t.Fatalf("%v %s at %s: [%s, %s), then [%s, %s)", z.Location, z.Period, at.In(z.Location), start.In(z.Location), end.In(z.Location),
			nextStart.In(z.Location), nextEnd.In(z.Location))
	}
	if _, prevEnd := z.WindowAt(start.Add(-time.Microsecond)); !prevEnd.Equal(start) {
		t.Fatalf("%v %s at %s: [%s, %s), the window before ends at %s", z.Location, z.Period, at.In(z.Location), start.In(z.Location), end.In(z.Location),
			prevEnd.In(z.Location))
	}
}

// zoneNames lists the locations of Go's time zone database (the zip time/tzdata embeds).
func zoneNames(t *testing.T) []string {
	t.Helper()
	goroot, err := exec.Command("go", "env", "GOROOT").Output()
	if err != nil {
		t.Fatalf("go env GOROOT: %v", err)
	}
	zr, err := zip.OpenReader(filepath.Join(strings.TrimSpace(string(goroot)), "lib", "time", "zoneinfo.zip"))
	if err != nil {
		t.Fatal(err)
	}
	defer zr.Close()
	var names []string
	for _, f := range zr.File {
		if !strings.HasSuffix(f.Name, "/") {
			names = append(names, f.Name)
		}
	}
	return names
}

// TestDayWindowWhereMidnightIsSkipped: where a daylight saving change skips midnight
// (America/Santiago 2026-09-05 24:00 -> 09-06 01:00, America/Havana 2026-03-08 00:00 -> 01:00),
// the last hour of the day before it is in that day's window, and a day's limit holds there
// (the window was [Sat 00:00, Sat 23:00), which does not hold 23:30, and the next one had no
// length: every request was admitted).
func TestDayWindowWhereMidnightIsSkipped(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	for _, c := range []struct{ tz, at, start, end string }{
		{"America/Santiago", "2026-09-05T23:30:00-04:00", "2026-09-05T00:00:00-04:00", "2026-09-06T01:00:00-03:00"},
		{"America/Havana", "2026-03-07T23:30:00-05:00", "2026-03-07T00:00:00-05:00", "2026-03-08T01:00:00-04:00"},
		{"Europe/Paris", "2026-03-28T23:30:00+01:00", "2026-03-28T00:00:00+01:00", "2026-03-29T00:00:00+01:00"}, // a change at 02:00
	} {
		t.Run(c.tz, func(t *testing.T) {
			loc := mustLoad(t, c.tz)
			at, wantStart, wantEnd := rfc3339(t, c.at), rfc3339(t, c.start), rfc3339(t, c.end)
			z := fw("daily", 3, limiter.Day, loc)
			if start, end := z.WindowAt(at); !start.Equal(wantStart) || !end.Equal(wantEnd) {
				t.Fatalf("WindowAt(%s) = [%s, %s), want [%s, %s)", at.In(loc), start.In(loc), end.In(loc), wantStart, wantEnd)
			}
			clk := &clock{t: at}
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
			admitted := 0
			for i := 0; i < 10; i++ {
				if allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1}).Allowed {
					admitted++
				}
				clk.Advance(1100 * time.Millisecond)
			}
			if admitted != 3 {
				t.Errorf("limit 3 per day: %d of 10 requests admitted within 11s of the same day", admitted)
			}
		})
	}
}

func rfc3339(t *testing.T, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339, s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
