package main

import (
	"archive/tar"
	"io"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// TestImageRunsTheBinaryAsNonRoot: the tarball and the pushed image both
// hold the binary at /idemcp as their entrypoint and the data plane at
// /idemcp-proxy, run as 65532, with a writable /tmp.
func TestImageRunsTheBinaryAsNonRoot(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "idemcp")
	if err := os.WriteFile(bin, []byte("#!/bin/true\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	proxyBin := filepath.Join(dir, "idemcp-proxy")
	if err := os.WriteFile(proxyBin, []byte("#!/bin/false\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	reg := httptest.NewServer(registry.New())
	defer reg.Close()
	ref := strings.TrimPrefix(reg.URL, "http://") + "/idemcp:test"
	out := filepath.Join(dir, "image.tar")
	if err := run(bin, proxyBin, out, ref, filepath.Join(dir, "no-ca-bundle"), true); err != nil {
		t.Fatal(err)
	}
	tag, _ := name.NewTag(ref)
	fromTar, err := tarball.ImageFromPath(out, &tag)
	if err != nil {
		t.Fatal(err)
	}
	pushed, err := remote.Image(tag)
	if err != nil {
		t.Fatalf("pulling the pushed image: %v", err)
	}
	d1, _ := fromTar.Digest()
	d2, _ := pushed.Digest()
	if d1 != d2 {
		t.Errorf("the tarball (%s) and the pushed image (%s) differ", d1, d2)
	}
	cf, err := pushed.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(cf.Config.Entrypoint, " "); got != "/idemcp" || cf.Config.User != "65532:65532" || cf.OS != "linux" {
		t.Errorf("config: entrypoint %q, user %q, os %q; want /idemcp, 65532:65532, linux", got, cf.Config.User, cf.OS)
	}
	layers, _ := pushed.Layers()
	if len(layers) != 1 || len(cf.RootFS.DiffIDs) != 1 {
		t.Fatalf("%d layers and %d diff ids, want 1 and 1", len(layers), len(cf.RootFS.DiffIDs))
	}
	files := layerFiles(t, layers[0])
	if h := files["idemcp"]; h == nil || h.Mode&0o111 == 0 {
		t.Errorf("the layer has no executable idemcp: %v", files)
	}
	if h := files["idemcp-proxy"]; h == nil || h.Mode&0o111 == 0 {
		t.Errorf("the layer has no executable idemcp-proxy (the binary the webhook injects): %v", files)
	}
	if h := files["tmp/"]; h == nil || h.Mode&0o1777 != 0o1777 {
		t.Errorf("the layer has no world-writable sticky /tmp: %v", files)
	}
}

// TestAppImageRunsItsOneBinary: --app writes an image whose entrypoint is
// the given binary at /app, non-root, for the demo's MCP server.
func TestAppImageRunsItsOneBinary(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "server")
	if err := os.WriteFile(bin, []byte("#!/bin/true\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "app.tar")
	if err := runApp(bin, out, "example.com/demo-server:test", filepath.Join(dir, "no-ca-bundle"), false); err != nil {
		t.Fatal(err)
	}
	tag, _ := name.NewTag("example.com/demo-server:test")
	img, err := tarball.ImageFromPath(out, &tag)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(cf.Config.Entrypoint, " "); got != "/app" || cf.Config.User != "65532:65532" {
		t.Errorf("config: entrypoint %q, user %q; want /app, 65532:65532", got, cf.Config.User)
	}
	layers, _ := img.Layers()
	if len(layers) != 1 {
		t.Fatalf("%d layers, want 1", len(layers))
	}
	files := layerFiles(t, layers[0])
	if h := files["app"]; h == nil || h.Mode&0o111 == 0 {
		t.Errorf("the layer has no executable app: %v", files)
	}
	if files["idemcp"] != nil {
		t.Errorf("the app image holds idemcp too: %v", files)
	}
	if err := runApp(filepath.Join(dir, "missing"), out, "example.com/x:1", "", false); err == nil || !strings.Contains(err.Error(), "--app") {
		t.Errorf("a missing --app binary: got %v, want an error naming --app", err)
	}
}

func layerFiles(t *testing.T, l v1.Layer) map[string]*tar.Header {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rc.Close() }()
	files := map[string]*tar.Header{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = h
	}
}
