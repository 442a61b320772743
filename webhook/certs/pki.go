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
	// The next CA, published in ca.crt ahead of use: it signs the serving
	// certificate only once it has been trusted for CAOverlap.
	nextCACertKey = "next-ca.crt"
	nextCAKeyKey  = "next-ca.key"
)

// clockSkew backdates NotBefore so that an API server whose clock is a
// little behind the manager's still accepts a certificate issued just now.
const clockSkew = 5 * time.Minute

// authority is the CA that signs serving certificates.
type authority struct {
	cert *x509.Certificate
	key  crypto.Signer
}

// publishedAt is when a CA made here was issued (its NotBefore is
// backdated by clockSkew).
func (ca *authority) publishedAt() time.Time { return ca.cert.NotBefore.Add(clockSkew) }

// plan returns the Secret data the webhook should be served with, given
// the data the Secret holds now (nil if it does not exist), and why it
// differs. It returns nil data when the current data is fine as it is.
//
// ca.crt is the bundle everyone verifies with: the current CA first, then
// the next CA while it is published, then any replaced CA that has not
// expired yet. A CA is replaced in two steps, so that nobody who verifies
// with a copy of the bundle taken before the rotation (a sidecar's
// IDEMCP_POLICY_CA, the caBundle of the webhook configuration) is cut off:
// RotateBefore the current CA's end, the next CA joins the bundle and the
// policy stream pushes it to every sidecar; CAOverlap later it signs the
// serving certificate, and the replaced CA stays in the bundle until it
// expires. Only when no usable CA is left is a new one used at once.
func plan(current map[string][]byte, o *Options, now time.Time) (map[string][]byte, string, error) {
	ca, older, err := parseAuthority(current)
	next := parseNext(current, now)
	if published, perr := parseCertificates(current[nextCACertKey]); perr == nil {
		// The next CA is listed in ca.crt as well; it is not a replaced one.
		older = slices.DeleteFunc(older, func(c *x509.Certificate) bool { return c.Equal(published[0]) })
	}
	var reason string
	switch {
	case current == nil:
		reason = "the Secret does not exist"
	case err != nil:
		reason = fmt.Sprintf("the Secret holds no usable CA: %v", err)
	case !now.Before(ca.cert.NotAfter):
		reason = fmt.Sprintf("the CA expired at %s", ca.cert.NotAfter.UTC().Format(time.RFC3339))
	case !now.Add(o.RotateBefore).Before(ca.cert.NotAfter) && next != nil && !now.Before(next.publishedAt().Add(o.CAOverlap)):
		reason = fmt.Sprintf("the CA expires at %s and the next CA has been published since %s", ca.cert.NotAfter.UTC().Format(time.RFC3339), next.publishedAt().UTC().Format(time.RFC3339))
	}
	if reason != "" {
		// Switch to the next CA, or to a new one if none was published.
		var keep []*x509.Certificate
		if err == nil {
			keep = unexpired(append([]*x509.Certificate{ca.cert}, older...), now)
		}
		if next == nil {
			if next, err = newAuthority(now, o.CAValidity); err != nil {
				return nil, "", err
			}
		}
		certPEM, keyPEM, err := next.issue(o.dnsNames(), now, o.CertValidity)
		if err != nil {
			return nil, "", err
		}
		data, err := secretData(next, nil, keep, certPEM, keyPEM)
		return data, reason, err
	}

	keep := unexpired(older, now)
	certPEM, keyPEM := current[corev1.TLSCertKey], current[corev1.TLSPrivateKeyKey]
	reason = servingProblem(certPEM, keyPEM, ca, o, now)
	nextProblem := ""
	if next == nil && !now.Add(o.RotateBefore).Before(ca.cert.NotAfter) {
		if next, err = newAuthority(now, o.CAValidity); err != nil {
			return nil, "", err
		}
		nextProblem = fmt.Sprintf("the CA expires at %s: publishing the next CA, which signs the serving certificate from %s",
			ca.cert.NotAfter.UTC().Format(time.RFC3339), now.Add(o.CAOverlap).UTC().Format(time.RFC3339))
	} else if next == nil && (len(current[nextCACertKey]) > 0 || len(current[nextCAKeyKey]) > 0) {
		nextProblem = "the published next CA is unusable or expired"
	}
	switch {
	case reason != "":
		if certPEM, keyPEM, err = ca.issue(o.dnsNames(), now, o.CertValidity); err != nil {
			return nil, "", err
		}
		if nextProblem != "" {
			reason += "; " + nextProblem
		}
	case nextProblem != "":
		reason = nextProblem
	case len(keep) != len(older):
		reason = "a replaced CA has expired"
	default:
		return nil, "", nil
	}
	data, err := secretData(ca, next, keep, certPEM, keyPEM)
	return data, reason, err
}

// parseNext reads the published next CA; nil if there is none, or it is
// unusable or expired (then a new one is published).
func parseNext(data map[string][]byte, now time.Time) *authority {
	if len(data[nextCACertKey]) == 0 {
		return nil
	}
	next, _, err := parseAuthority(map[string][]byte{caCertKey: data[nextCACertKey], caKeyKey: data[nextCAKeyKey]})
	if err != nil || !now.Before(next.cert.NotAfter) {
		return nil
	}
	return next
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
	// A certificate that ends with its CA cannot be renewed for longer:
	// the CA's rotation replaces it.
	if !now.Add(o.RotateBefore).Before(leaf.NotAfter) && leaf.NotAfter.Before(ca.cert.NotAfter) {
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

// secretData lays out a CA, the published next CA (nil if none), the
// replaced CAs kept in ca.crt, and a serving key pair as Secret data.
func secretData(ca, next *authority, older []*x509.Certificate, certPEM, keyPEM []byte) (map[string][]byte, error) {
	caKeyPEM, err := encodeKey(ca.key)
	if err != nil {
		return nil, err
	}
	trusted := []*x509.Certificate{ca.cert}
	if next != nil {
		trusted = append(trusted, next.cert)
	}
	var bundle bytes.Buffer
	for _, c := range append(trusted, older...) {
		_ = pem.Encode(&bundle, &pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
	}
	data := map[string][]byte{
		caCertKey:               bundle.Bytes(),
		caKeyKey:                caKeyPEM,
		corev1.TLSCertKey:       certPEM,
		corev1.TLSPrivateKeyKey: keyPEM,
	}
	if next != nil {
		nextKeyPEM, err := encodeKey(next.key)
		if err != nil {
			return nil, err
		}
		data[nextCACertKey] = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: next.cert.Raw})
		data[nextCAKeyKey] = nextKeyPEM
	}
	return data, nil
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
