package freeport

import "testing"

// TestGetNeverRepeats: 2000 ports in a row are distinct. Listening on port 0 and closing, as the
// tests did before, repeats a port within that many (the birthday bound of ~28000 ephemeral
// ports): two sites of one test once got the same port.
func TestGetNeverRepeats(t *testing.T) {
	seen := make(map[int]bool)
	for range 2000 {
		p := Must(t)
		if seen[p] {
			t.Fatalf("port %d returned twice", p)
		}
		seen[p] = true
	}
}
