package limiter

import "time"

// calendarWindow returns the window of period p (Hour, Day, Week or Month) in loc that holds t:
// [start, end) with start <= t < end and end > start, each window starting where the previous
// one ended, whatever loc's clock changes do.
//
// A day, week or month starts at the first instant at which loc's calendar date is its first
// date or later (wallStart). Where a daylight saving change skips midnight (America/Santiago,
// 2026-09-06: Saturday 24:00 is Sunday 01:00), Sunday starts at the change, so Saturday ends
// there; a date that does not exist at all (Pacific/Apia skipped 2011-12-30) has no window.
// Where a change sets the clock back across midnight, the day whose midnight came first starts
// then, and the repeated hour belongs to it.
//
// An hour starts where the clock reads :00 at the offset in force, or at a change of offset: a
// repeated hour (America/New_York, 2026-11-01 01:00-02:00) is two windows of an hour each, and a
// half-hour change (Australia/Lord_Howe) makes a window of half an hour.
func calendarWindow(p Period, t time.Time, loc *time.Location) (start, end time.Time) {
	lt := t.In(loc)
	if p == Hour {
		return hourWindow(lt)
	}
	y, mo, d := lt.Date()
	switch p {
	case Week:
		d -= (int(lt.Weekday()) + 6) % 7 // back to Monday
	case Month:
		d = 1
	}
	first := time.Date(y, mo, d, 0, 0, 0, 0, time.UTC) // the window's first date, as a wall clock reading
	start = wallStart(first, loc)
	for {
		next := nextPeriod(p, first)
		end = wallStart(next, loc)
		if t.Before(end) {
			return start.In(loc), end.In(loc)
		}
		// The clock was set back across the next period's first midnight: t's date is an earlier
		// one, but the next period began before t.
		first, start = next, end
	}
}

// nextPeriod returns the first date of the period after the one whose first date is first.
func nextPeriod(p Period, first time.Time) time.Time {
	switch p {
	case Week:
		return first.AddDate(0, 0, 7)
	case Month:
		return first.AddDate(0, 1, 0)
	}
	return first.AddDate(0, 0, 1)
}

// wallStart returns the first instant at which loc's clock reads wall (a wall clock reading,
// written in UTC) or later. It walks loc's offsets from 3 days before wall (more than any offset
// a zone has ever had): within one offset the clock runs on, so the reading is reached where the
// offset puts it, or, if that lies beyond the offset's end, no earlier than the next offset's
// start; an offset that starts with the clock already past wall (a change skipping it) starts
// at its beginning.
func wallStart(wall time.Time, loc *time.Location) time.Time {
	u := wall.Add(-72 * time.Hour)
	for {
		lu := u.In(loc)
		_, off := lu.Zone()
		at := wall.Add(-time.Duration(off) * time.Second)
		if !at.After(u) {
			return u
		}
		_, end := lu.ZoneBounds()
		if end.IsZero() || at.Before(end) {
			return at
		}
		u = end
	}
}

// hourWindow returns the hour holding lt (a time in its location): from the last time the
// clock read :00 at lt's offset, or from the offset's start if that is later, to the next :00
// at that offset, or to the offset's end if that is sooner.
func hourWindow(lt time.Time) (start, end time.Time) {
	_, off := lt.Zone()
	o := time.Duration(off) * time.Second
	start = lt.Add(o).Truncate(time.Hour).Add(-o) // Truncate works on the absolute time: shift by the offset
	end = start.Add(time.Hour)
	from, to := lt.ZoneBounds()
	if !from.IsZero() && start.Before(from) {
		start = from
	}
	if !to.IsZero() && end.After(to) {
		end = to
	}
	return start.In(lt.Location()), end.In(lt.Location())
}
