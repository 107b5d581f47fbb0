package limiter

import "strings"

// slots is the number of Redis Cluster hash slots.
const slots = 16384

// hashSlot returns the Redis Cluster hash slot of key: CRC16 (XMODEM) of its hash tag — the
// bytes between the first '{' and the next '}', when that is not empty — or of the whole key,
// modulo 16384, as the Redis Cluster specification defines it ("Keys distribution model").
func hashSlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	return int(crc16(key) % slots)
}

// crc16 is CRC-16/XMODEM (polynomial 0x1021, initial value 0), the checksum of Redis Cluster.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for b := 0; b < 8; b++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}
