package certs

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// Keys of the Secret besides tls.crt and tls.key.
const (
	caCertKey = "ca.crt"
	caKeyKey  = "ca.key"
)

// clockSkew backdates NotBefore so that an API server whose clock is a
// little behind the manager's still accepts a certificate issued just now.
const clockSkew = 5 * time.Minute

// authority is the CA that signs serving certificates.
type authority struct {
	cert *x509.Certificate
	key  crypto.Signer
}

// plan returns the Secret data the webhook should be served with, given
// the data the Secret holds now (nil if it does not exist), and why it
// differs. It returns nil data when the current data is fine as it is.
//
// ca.crt holds the current CA first, then any replaced CA that has not
// expired yet: a replica still serving a certificate from the old CA stays
// trusted until it picks up the new one.
func plan(current map[string][]byte, o *Options, now time.Time) (map[string][]byte, string, error) {
	ca, older, err := parseAuthority(current)
	var reason string
	switch {
	case current == nil:
		reason = "the Secret does not exist"
	case err != nil:
		reason = fmt.Sprintf("the Secret holds no usable CA: %v", err)
	case !now.Add(o.RotateBefore).Before(ca.cert.NotAfter):
		reason = fmt.Sprintf("the CA expires at %s", ca.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	if reason != "" {
		var keep []*x509.Certificate
		if err == nil {
			keep = unexpired(append([]*x509.Certificate{ca.cert}, older...), now)
		}
		ca, err := newAuthority(now, o.CAValidity)
		if err != nil {
			return nil, "", err
		}
		certPEM, keyPEM, err := ca.issue(o.dnsNames(), now, o.CertValidity)
		if err != nil {
			return nil, "", err
		}
		data, err := secretData(ca, keep, certPEM, keyPEM)
		return data, reason, err
	}

	keep := unexpired(older, now)
	certPEM, keyPEM := current[corev1.TLSCertKey], current[corev1.TLSPrivateKeyKey]
	reason = servingProblem(certPEM, keyPEM, ca, o, now)
	switch {
	case reason != "":
		if certPEM, keyPEM, err = ca.issue(o.dnsNames(), now, o.CertValidity); err != nil {
			return nil, "", err
		}
	case len(keep) != len(older):
		reason = "a replaced CA has expired"
	default:
		return nil, "", nil
	}
	data, err := secretData(ca, keep, certPEM, keyPEM)
	return data, reason, err
}

// servingProblem says why the serving key pair must be reissued, or "" if
// it needs not.
func servingProblem(certPEM, keyPEM []byte, ca *authority, o *Options, now time.Time) string {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return fmt.Sprintf("the serving key pair is unusable: %v", err)
	}
	leaf := pair.Leaf
	if leaf == nil { // only under GODEBUG=x509keypairleaf=0
		if leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return fmt.Sprintf("the serving certificate is unusable: %v", err)
		}
	}
	if want := sorted(o.dnsNames()); !slices.Equal(sorted(leaf.DNSNames), want) {
		return fmt.Sprintf("the serving certificate names %v, not %v", leaf.DNSNames, want)
	}
	if !now.Add(o.RotateBefore).Before(leaf.NotAfter) {
		return fmt.Sprintf("the serving certificate expires at %s", leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.cert)
	if _, err := leaf.Verify(x509.VerifyOptions{
		DNSName:     o.serverName(),
		Roots:       roots,
		CurrentTime: now,
		KeyUsages:   []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}); err != nil {
		return fmt.Sprintf("the serving certificate does not verify against the CA: %v", err)
	}
	return ""
}

// parseAuthority reads the CA from ca.crt (its first certificate) and
// ca.key, and the replaced CAs that follow it in ca.crt.
func parseAuthority(data map[string][]byte) (*authority, []*x509.Certificate, error) {
	certs, err := parseCertificates(data[caCertKey])
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", caCertKey, err)
	}
	key, err := parsePrivateKey(data[caKeyKey])
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", caKeyKey, err)
	}
	ca := &authority{cert: certs[0], key: key}
	if !ca.cert.IsCA {
		return nil, nil, fmt.Errorf("%s: the first certificate is not a CA", caCertKey)
	}
	pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(ca.cert.PublicKey) {
		return nil, nil, fmt.Errorf("%s does not match the first certificate of %s", caKeyKey, caCertKey)
	}
	return ca, certs[1:], nil
}

func newAuthority(now time.Time, validity time.Duration) (*authority, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating the CA key: %w", err)
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		// The timestamp tells a CA from the one it replaced.
		Subject:               pkix.Name{CommonName: fmt.Sprintf("idemcp-webhook-ca@%d", now.Unix())},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("self-signing the CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parsing the new CA: %w", err)
	}
	return &authority{cert: cert, key: key}, nil
}

// issue signs a new serving key pair for dnsNames, valid for validity but
// never past the CA.
func (ca *authority) issue(dnsNames []string, now time.Time, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generating the serving key: %w", err)
	}
	serial, err := newSerial()
	if err != nil {
		return nil, nil, err
	}
	notAfter := now.Add(validity)
	if notAfter.After(ca.cert.NotAfter) {
		notAfter = ca.cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		// The API server dials the third name, <svc>.<ns>.svc.
		Subject:     pkix.Name{CommonName: dnsNames[2]},
		DNSNames:    dnsNames,
		NotBefore:   now.Add(-clockSkew),
		NotAfter:    notAfter,
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("signing the serving certificate: %w", err)
	}
	keyPEM, err = encodeKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keyPEM, nil
}

// secretData lays out a CA, the replaced CAs kept in ca.crt, and a serving
// key pair as Secret data.
func secretData(ca *authority, older []*x509.Certificate, certPEM, keyPEM []byte) (map[string][]byte, error) {
	caKeyPEM, err := encodeKey(ca.key)
	if err != nil {
		return nil, err
	}
	var bundle bytes.Buffer
	for _, c := range append([]*x509.Certificate{ca.cert}, older...) {
		_ = pem.Encode(&bundle, &pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
	}
	return map[string][]byte{
		caCertKey:               bundle.Bytes(),
		caKeyKey:                caKeyPEM,
		corev1.TLSCertKey:       certPEM,
		corev1.TLSPrivateKeyKey: keyPEM,
	}, nil
}

func parseCertificates(pemBytes []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	for {
		var block *pem.Block
		block, pemBytes = pem.Decode(pemBytes)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, err
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, errors.New("no PEM certificate")
	}
	return certs, nil
}

// parsePrivateKey accepts the PEM encodings openssl and Go write, so a CA
// someone put in the Secret by hand is used rather than replaced.
func parsePrivateKey(pemBytes []byte) (crypto.Signer, error) {
	block, _ := pem.Decode(pemBytes)
	if block == nil {
		return nil, errors.New("no PEM private key")
	}
	var key any
	var err error
	switch block.Type {
	case "EC PRIVATE KEY":
		key, err = x509.ParseECPrivateKey(block.Bytes)
	case "RSA PRIVATE KEY":
		key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
	default:
		key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
	}
	if err != nil {
		return nil, err
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("a %T cannot sign", key)
	}
	return signer, nil
}

func encodeKey(key crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encoding a private key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

func newSerial() (*big.Int, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("generating a serial number: %w", err)
	}
	return serial, nil
}

func unexpired(certs []*x509.Certificate, now time.Time) []*x509.Certificate {
	var keep []*x509.Certificate
	for _, c := range certs {
		if now.Before(c.NotAfter) {
			keep = append(keep, c)
		}
	}
	return keep
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}
