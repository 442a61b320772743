package controllers_test

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// The managed Redis refuses every client without the password: the
// controller's own Secret and StatefulSet, rendered by a real API server,
// run as a real redis-server with the container's arguments (only the
// mounted paths moved to a temp dir, and a loopback port).
func TestManagedRedisRefusesClientsWithoutThePassword(t *testing.T) {
	bin := redistest.Binary(t, "redis-server")
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "payments")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "payments-redis"}
	var secret corev1.Secret
	var sts appsv1.StatefulSet
	eventually(t, "the Secret and StatefulSet", func() error {
		return errors.Join(k8s.Get(ctx, key, &secret), k8s.Get(ctx, key, &sts))
	})
	c := sts.Spec.Template.Spec.Containers[0]
	// Mount the Secret's files where the pod would see them, in a temp dir.
	dir := t.TempDir()
	mounts := map[string]string{}
	for _, vm := range c.VolumeMounts {
		local := filepath.Join(dir, strings.ReplaceAll(strings.Trim(vm.MountPath, "/"), "/", "_"))
		if err := os.MkdirAll(local, 0o700); err != nil {
			t.Fatal(err)
		}
		mounts[vm.MountPath] = local
		for _, v := range sts.Spec.Template.Spec.Volumes {
			if v.Name != vm.Name || v.Secret == nil {
				continue
			}
			if v.Secret.SecretName != secret.Name {
				t.Fatalf("volume %s mounts Secret %s, not the policy's %s", v.Name, v.Secret.SecretName, secret.Name)
			}
			for _, item := range v.Secret.Items {
				if err := os.WriteFile(filepath.Join(local, item.Path), secret.Data[item.Key], 0o600); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	var args []string
	for _, a := range c.Args {
		for mount, local := range mounts {
			if a == mount || strings.HasPrefix(a, mount+"/") {
				a = local + strings.TrimPrefix(a, mount)
			}
		}
		args = append(args, a)
	}
	if strings.Contains(strings.Join(args, " "), string(secret.Data["password"])) {
		t.Fatal("the password is on Redis's command line, where ps shows it")
	}
	port := freeport.LoopbackPort(t)
	args = append(args, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--daemonize", "no", "--maxmemory", "64mb")
	cmd := exec.Command(bin, args...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	addr := "127.0.0.1:" + strconv.Itoa(port)

	// Until it answers at all: then PING without the password is refused.
	var pingErr error
	deadline := time.Now().Add(15 * time.Second)
	for {
		_, pingErr = redistest.Do(addr, "PING")
		if pingErr == nil || !isConnErr(pingErr) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("redis-server %v never answered: %v\n%s", args, pingErr, out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if pingErr == nil || !strings.Contains(pingErr.Error(), "NOAUTH") {
		t.Fatalf("PING without the password: %v; want NOAUTH", pingErr)
	}
	anon := goredis.NewClient(&goredis.Options{Addr: addr, MaxRetries: -1})
	defer func() { _ = anon.Close() }()
	if err := anon.Set(ctx, "planted", "x", 0).Err(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("SET without the password: %v; want NOAUTH", err)
	}
	wrong := goredis.NewClient(&goredis.Options{Addr: addr, Password: "not-the-password", MaxRetries: -1})
	defer func() { _ = wrong.Close() }()
	if err := wrong.Ping(ctx).Err(); err == nil {
		t.Error("a wrong password was accepted")
	}
	// The sidecar's way in: the password from the Secret.
	authed := goredis.NewClient(&goredis.Options{Addr: addr, Password: string(secret.Data["password"])})
	defer func() { _ = authed.Close() }()
	if err := authed.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Errorf("SET with the Secret's password: %v", err)
	}
}

func isConnErr(err error) bool {
	var ne net.Error
	var oe *net.OpError
	return errors.As(err, &ne) || errors.As(err, &oe) || strings.Contains(err.Error(), "EOF") || strings.Contains(err.Error(), "empty reply")
}
