package ratelimitredis

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
)

// load returns the crypto/tls config of t, reading its PEM files now; nil for a nil t (no
// TLS). The errors name the file and what is wrong with it.
func (t *TLSConfig) load() (*tls.Config, error) {
	if t == nil {
		return nil, nil
	}
	c := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         t.ServerName,
		InsecureSkipVerify: t.InsecureSkipVerify, //nolint:gosec // the operator asked for it, for testing
	}
	if t.CA != "" {
		pem, err := os.ReadFile(t.CA)
		if err != nil {
			return nil, fmt.Errorf("redis tls ca: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("redis tls ca %s: no PEM certificate found", t.CA)
		}
	}
	if t.Cert != "" {
		cert, err := tls.LoadX509KeyPair(t.Cert, t.Key)
		if err != nil {
			return nil, fmt.Errorf("redis tls cert %s and key %s: %w", t.Cert, t.Key, err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}
