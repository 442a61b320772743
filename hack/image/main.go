// Command image writes idemcp's container image as an OCI tarball without a
// Docker engine: one layer holding the two static binaries the Dockerfile builds
// (/idemcp, and /idemcp-proxy that the webhook injects as the sidecar)
// (and the system's CA bundle, for Redis TLS), run as user 65532 like the
// Dockerfile's distroless base. Import it with `ctr images import`,
// `kind load image-archive`, or push it with --push (make image-push).
//
// With --app instead, it writes an image of one other static binary at
// /app, its entrypoint, on the same base: the demo's MCP server
// (make demo-images), or a test server.
package main

import (
	"archive/tar"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

func main() {
	binary := flag.String("binary", "", "the static linux idemcp binary to put in the image")
	proxyBinary := flag.String("proxy-binary", "", "the static linux idemcp-proxy binary (the data plane alone) to put in the image")
	out := flag.String("out", "", "the OCI tarball to write")
	ref := flag.String("image", "ghcr.io/idemcp/idemcp:dev", "the image's name and tag")
	caBundle := flag.String("ca-bundle", "/etc/ssl/certs/ca-certificates.crt", "CA certificates to include (skipped if the file does not exist)")
	push := flag.Bool("push", false, "also push the image to its registry (credentials from ~/.docker/config.json, as docker login writes them)")
	app := flag.String("app", "", "instead of idemcp, an image of this one static binary at /app, its entrypoint")
	flag.Parse()
	var err error
	if *app != "" {
		err = runApp(*app, *out, *ref, *caBundle, *push)
	} else {
		err = run(*binary, *proxyBinary, *out, *ref, *caBundle, *push)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "image: %v\n", err)
		os.Exit(1)
	}
}

func run(binary, proxyBinary, out, ref, caBundle string, push bool) error {
	if binary == "" || proxyBinary == "" || out == "" {
		return fmt.Errorf("--binary, --proxy-binary and --out are required")
	}
	bin, err := os.ReadFile(binary)
	if err != nil {
		return err
	}
	proxy, err := os.ReadFile(proxyBinary)
	if err != nil {
		return err
	}
	return write([]file{{path: "idemcp", mode: 0o755, data: bin}, {path: "idemcp-proxy", mode: 0o755, data: proxy}}, "/idemcp", out, ref, caBundle, push)
}

// runApp writes the image of one binary at /app.
func runApp(app, out, ref, caBundle string, push bool) error {
	if out == "" {
		return fmt.Errorf("--out is required")
	}
	bin, err := os.ReadFile(app)
	if err != nil {
		return fmt.Errorf("--app: %w", err)
	}
	return write([]file{{path: "app", mode: 0o755, data: bin}}, "/app", out, ref, caBundle, push)
}

// write builds the image of files (plus /tmp and the CA bundle), run as
// 65532 with entrypoint, and writes it to out, pushing it too if asked.
func write(files []file, entrypoint, out, ref, caBundle string, push bool) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return fmt.Errorf("--image %q: %w", ref, err)
	}
	files = append(files, file{path: "tmp/", mode: 0o1777})
	if ca, err := os.ReadFile(caBundle); err == nil {
		files = append(files, file{path: "etc/ssl/certs/", mode: 0o755}, file{path: "etc/ssl/certs/ca-certificates.crt", mode: 0o644, data: ca})
	}
	layerTar, err := tarOf(files)
	if err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil })
	if err != nil {
		return fmt.Errorf("building the layer: %w", err)
	}
	// The config first, then the layer, so that AppendLayers records the
	// layer's diff id and history in it.
	base, err := mutate.ConfigFile(empty.Image, &v1.ConfigFile{
		Architecture: "amd64",
		OS:           "linux",
		Config: v1.Config{
			Entrypoint: []string{entrypoint},
			User:       "65532:65532",
		},
		RootFS: v1.RootFS{Type: "layers"},
	})
	if err != nil {
		return err
	}
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return err
	}
	if err := tarball.WriteToFile(out, tag, img); err != nil {
		return err
	}
	if push {
		if err := remote.Write(tag, img, remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
			return fmt.Errorf("pushing %s: %w", tag, err)
		}
		fmt.Printf("pushed %s\n", tag)
	}
	return nil
}

type file struct {
	path string
	mode int64
	data []byte
}

func tarOf(files []file) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	// A fixed time keeps the layer, and so the image digest, reproducible.
	mtime := time.Unix(0, 0)
	for _, f := range files {
		h := &tar.Header{Name: f.path, Mode: f.mode, ModTime: mtime, Uid: 0, Gid: 0}
		if f.path[len(f.path)-1] == '/' {
			h.Typeflag = tar.TypeDir
		} else {
			h.Typeflag = tar.TypeReg
			h.Size = int64(len(f.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
