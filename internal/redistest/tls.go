package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TLSServer is a redis-server that also listens with TLS and requires client certificates,
// with a test CA generated for it (no files committed).
type TLSServer struct {
	*Server
	// TLSAddr is the TLS listener's host:port; Server.Addr stays a plain listener, for the
	// test's own inspection.
	TLSAddr string
	// CA is the PEM file of the CA that signed the server and client certificates.
	CA string
	// ClientCert and ClientKey are a PEM client certificate signed by CA, and its key.
	ClientCert, ClientKey string
	// OtherCA is the PEM file of a CA that signed nothing here: trusting it alone must fail.
	OtherCA string
}

// StartTLS starts a redis-server with a TLS port (certificate for 127.0.0.1 and localhost,
// client certificates required) besides its plain port. Extra redis-server arguments may be
// given, as for Start.
func StartTLS(t testing.TB, extra ...string) *TLSServer {
	t.Helper()
	dir := t.TempDir()
	s := &TLSServer{
		CA: filepath.Join(dir, "ca.pem"), OtherCA: filepath.Join(dir, "other-ca.pem"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client.key"),
	}
	caCert, caKey := newCA(t, "redistest CA")
	writePEM(t, s.CA, "CERTIFICATE", caCert.Raw)
	other, _ := newCA(t, "redistest other CA")
	writePEM(t, s.OtherCA, "CERTIFICATE", other.Raw)
	serverCert, serverKey := filepath.Join(dir, "server.pem"), filepath.Join(dir, "server.key")
	issue(t, caCert, caKey, serverCert, serverKey, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "localhost"},
		DNSNames:    []string{"localhost"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	issue(t, caCert, caKey, s.ClientCert, s.ClientKey, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "redistest client"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	port, err := freePort()
	if err != nil {
		t.Fatalf("finding a free port: %v", err)
	}
	s.TLSAddr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	s.Server = Start(t, append([]string{
		"--tls-port", strconv.Itoa(port), "--tls-cert-file", serverCert, "--tls-key-file", serverKey,
		"--tls-ca-cert-file", s.CA, "--tls-auth-clients", "yes",
	}, extra...)...)
	return s
}

func newCA(t testing.TB, name string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// issue writes a certificate for tmpl, signed by ca, and its new key, as PEM files.
func issue(t testing.TB, ca *x509.Certificate, caKey *ecdsa.PrivateKey, certFile, keyFile string, tmpl *x509.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		t.Fatal(err)
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, certFile, "CERTIFICATE", der)
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, keyFile, "EC PRIVATE KEY", kb)
}

func writePEM(t testing.TB, file, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}
