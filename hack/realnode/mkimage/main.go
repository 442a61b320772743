// Command mkimage writes an OCI image tarball holding the given files, with
// no Docker engine and no registry: the real-node e2e cluster imports it with
// `ctr -n k8s.io images import`. Each --file is HOST_PATH=IMAGE_PATH (the
// file's content and mode are copied; symlinks are followed).
//
//	mkimage --image registry.local/pause:1.0 --out pause.tar \
//	  --file bin/pause=/pause --entrypoint /pause
package main

import (
	"archive/tar"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

type fileList []string

func (f *fileList) String() string     { return strings.Join(*f, ",") }
func (f *fileList) Set(v string) error { *f = append(*f, v); return nil }

func main() {
	var files fileList
	flag.Var(&files, "file", "HOST_PATH=IMAGE_PATH to put in the image (repeatable)")
	ref := flag.String("image", "", "the image's name and tag")
	out := flag.String("out", "", "the OCI tarball to write")
	entrypoint := flag.String("entrypoint", "", "the entrypoint, words separated by spaces")
	user := flag.String("user", "", "the user the image runs as (default root)")
	flag.Parse()
	if err := run(files, *ref, *out, *entrypoint, *user); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func run(files []string, ref, out, entrypoint, user string) error {
	if ref == "" || out == "" || len(files) == 0 {
		return fmt.Errorf("--image, --out and at least one --file are required")
	}
	tag, err := name.NewTag(ref)
	if err != nil {
		return err
	}
	layer, err := layerOf(files)
	if err != nil {
		return err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = "amd64", "linux"
	cf.Config.Entrypoint = strings.Fields(entrypoint)
	cf.Config.User = user
	cf.Config.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	return tarball.WriteToFile(out, tag, img)
}

func layerOf(files []string) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mtime := time.Unix(0, 0)
	dirs := map[string]bool{"tmp": true}
	type entry struct{ src, dst string }
	var entries []entry
	for _, f := range files {
		src, dst, ok := strings.Cut(f, "=")
		if !ok {
			return nil, fmt.Errorf("--file %q is not HOST_PATH=IMAGE_PATH", f)
		}
		dst = strings.TrimPrefix(path.Clean("/"+dst), "/")
		for d := path.Dir(dst); d != "." && d != "/"; d = path.Dir(d) {
			dirs[d] = true
		}
		entries = append(entries, entry{src, dst})
	}
	var dl []string
	for d := range dirs {
		dl = append(dl, d)
	}
	sort.Strings(dl)
	for _, d := range dl {
		mode := int64(0o755)
		if d == "tmp" {
			mode = 0o1777
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: mode, ModTime: mtime}); err != nil {
			return nil, err
		}
	}
	for _, e := range entries {
		data, err := os.ReadFile(e.src)
		if err != nil {
			return nil, err
		}
		st, err := os.Stat(e.src)
		if err != nil {
			return nil, err
		}
		h := &tar.Header{Typeflag: tar.TypeReg, Name: e.dst, Mode: int64(st.Mode().Perm()), Size: int64(len(data)), ModTime: mtime}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	b := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
}
