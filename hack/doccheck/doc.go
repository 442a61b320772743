// Package doccheck holds the tests that keep README.md and docs/*.md true
// to the code (go test ./hack/doccheck, part of make test): every relative
// link and #anchor resolves, every idemcp.io/ annotation and label has a
// row in docs/annotations.md, every IdempotencyPolicy field one in
// docs/policy.md (with the README's summaries naming what users set), and
// every JSON-RPC error code one in docs/errors.md.
package doccheck
