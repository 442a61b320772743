// Command dns is the real-node e2e cluster's DNS: it answers A queries for
// SERVICE.NAMESPACE.svc.DOMAIN with the Service's cluster IP, read from the
// API server, and NXDOMAIN for anything else. It is just enough for pods to
// reach Services by name (the injected sidecar dials its policy stream and a
// managed Redis that way) without running CoreDNS. It serves UDP only, as the
// pods' resolvers ask over UDP first and every answer fits in one datagram.
//
//	dns --kubeconfig admin.kubeconfig --listen 10.201.0.1:53
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster")
	listen := flag.String("listen", "10.201.0.1:53", "UDP address to answer on")
	domain := flag.String("domain", "cluster.local", "the cluster's DNS domain")
	flag.Parse()
	if err := run(*kubeconfig, *listen, *domain); err != nil {
		fmt.Fprintln(os.Stderr, "dns:", err)
		os.Exit(1)
	}
}

func run(kubeconfig, listen, domain string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	f := informers.NewSharedInformerFactory(cs, 10*time.Minute)
	svcs := f.Core().V1().Services()
	lister := svcs.Lister()
	synced := svcs.Informer().HasSynced
	f.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), synced) {
		return fmt.Errorf("services never synced")
	}
	conn, err := net.ListenPacket("udp", listen)
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); _ = conn.Close() }()
	suffix := ".svc." + strings.Trim(strings.ToLower(domain), ".") + "."
	buf := make([]byte, 1500)
	for {
		n, addr, err := conn.ReadFrom(buf)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if out, ok := answer(buf[:n], suffix, lister); ok {
			_, _ = conn.WriteTo(out, addr)
		}
	}
}

// answer builds the reply to one query; false drops what does not parse.
func answer(query []byte, suffix string, lister listers.ServiceLister) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil || h.Response {
		return nil, false
	}
	q, err := p.Question()
	if err != nil {
		return nil, false
	}
	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired, RCode: dnsmessage.RCodeNameError}
	var ip netip.Addr
	if name := strings.ToLower(q.Name.String()); strings.HasSuffix(name, suffix) {
		parts := strings.Split(strings.TrimSuffix(name, suffix), ".")
		if len(parts) == 2 {
			if s, err := lister.Services(parts[1]).Get(parts[0]); err == nil {
				rh.RCode = dnsmessage.RCodeSuccess
				ip = clusterIP(s)
			}
		} else if len(parts) == 1 && namespaceExists(lister, parts[0]) {
			rh.RCode = dnsmessage.RCodeSuccess
		}
	}
	b := dnsmessage.NewBuilder(make([]byte, 0, 512), rh)
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil, false
	}
	if err := b.Question(q); err != nil {
		return nil, false
	}
	if err := b.StartAnswers(); err != nil {
		return nil, false
	}
	if q.Type == dnsmessage.TypeA && ip.Is4() {
		if err := b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 5}, dnsmessage.AResource{A: ip.As4()}); err != nil {
			return nil, false
		}
	}
	out, err := b.Finish()
	return out, err == nil
}

func clusterIP(s *corev1.Service) netip.Addr {
	ip, err := netip.ParseAddr(s.Spec.ClusterIP)
	if err != nil {
		return netip.Addr{}
	}
	return ip
}

func namespaceExists(lister listers.ServiceLister, ns string) bool {
	l, err := lister.Services(ns).List(labels.Everything())
	return err == nil && len(l) > 0
}
