package webhook

import (
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/endpointslice"
)

// portPlan is how the sidecar takes the MCP server's place in the pod: the
// rule is that every Service that reached the server by a port name reaches
// the sidecar instead.
type portPlan struct {
	// upstream is the server's port number; server is its declaration, nil
	// when only the annotation names it.
	upstream int32
	server   *corev1.ContainerPort
	serverC  *corev1.Container
	// name is the name the sidecar's proxy port takes over: the server
	// port's own name, or "mcp" when the server's port has none and no port
	// of the pod is called that.
	name string
	// shadowed are the other ports that had that name: renamed, since a
	// Service resolves a name to the first port that has it, and the
	// sidecar must be the only one.
	shadowed []namedPort
	// hostPort and hostIP move from the server's port to the sidecar's, so
	// traffic through the node goes through the sidecar too.
	hostPort int32
	hostIP   string
	// proxyPort and adminPort are the sidecar's ports: the configured ones,
	// or the next free ones.
	proxyPort, adminPort int32
}

type namedPort struct {
	c *corev1.Container
	i int
}

// allContainers is every init and regular container of the pod.
func allContainers(pod *corev1.Pod) []*corev1.Container {
	var out []*corev1.Container
	for i := range pod.Spec.InitContainers {
		out = append(out, &pod.Spec.InitContainers[i])
	}
	for i := range pod.Spec.Containers {
		out = append(out, &pod.Spec.Containers[i])
	}
	return out
}

// servingContainers are the containers a Service's named targetPort can
// resolve to, in the order the EndpointSlice controller looks at them:
// regular containers, then native sidecars.
func servingContainers(pod *corev1.Pod) []*corev1.Container {
	var out []*corev1.Container
	for i := range pod.Spec.Containers {
		out = append(out, &pod.Spec.Containers[i])
	}
	for i := range pod.Spec.InitContainers {
		c := &pod.Spec.InitContainers[i]
		if c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways {
			out = append(out, c)
		}
	}
	return out
}

func protocolOf(p corev1.ContainerPort) corev1.Protocol {
	if p.Protocol == "" {
		return corev1.ProtocolTCP
	}
	return p.Protocol
}

// planPorts finds the MCP server's port (the annotation, else the port a
// Service with targetPort: mcp reaches, else the pod's only TCP port) and
// the sidecar's ports, or refuses.
func planPorts(pod *corev1.Pod, cfg Config) (*portPlan, error) {
	plan := &portPlan{}
	serving := servingContainers(pod)
	find := func(match func(corev1.ContainerPort) bool) (*corev1.Container, *corev1.ContainerPort) {
		for _, c := range serving {
			for j := range c.Ports {
				if match(c.Ports[j]) {
					return c, &c.Ports[j]
				}
			}
		}
		return nil, nil
	}

	if v, ok := pod.Annotations[AnnotationUpstreamPort]; ok {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil || n < 1 || n > 65535 {
			return nil, refuse(DenyNoUpstreamPort, "annotation %s is %q: give the MCP server's port as a number from 1 to 65535", AnnotationUpstreamPort, v)
		}
		plan.upstream = int32(n)
		plan.serverC, plan.server = find(func(p corev1.ContainerPort) bool {
			return p.ContainerPort == plan.upstream && protocolOf(p) == corev1.ProtocolTCP
		})
		if plan.server == nil {
			if c, p := find(func(p corev1.ContainerPort) bool { return p.ContainerPort == plan.upstream }); p != nil {
				return nil, refuse(DenyNotTCP, "container %s declares port %d as %s only: the MCP server must listen on TCP; declare it with protocol TCP", c.Name, p.ContainerPort, p.Protocol)
			}
		}
	} else {
		if c, p := find(func(p corev1.ContainerPort) bool { return p.Name == PortNameMCP && protocolOf(p) != corev1.ProtocolTCP }); p != nil {
			return nil, refuse(DenyNotTCP, "container %s's port %q is %s: MCP runs over TCP; make the port TCP, or rename it and point %s at the MCP server's TCP port", c.Name, PortNameMCP, p.Protocol, AnnotationUpstreamPort)
		}
		// What a Service with targetPort: mcp reached before injection.
		if n, err := endpointslice.FindPort(withProtocols(pod), &corev1.ServicePort{TargetPort: intstr.FromString(PortNameMCP), Protocol: corev1.ProtocolTCP}); err == nil {
			plan.upstream = int32(n)
			plan.serverC, plan.server = find(func(p corev1.ContainerPort) bool { return p.Name == PortNameMCP })
		} else {
			var tcp int
			plan.serverC, plan.server = nil, nil
			for _, c := range serving {
				for j := range c.Ports {
					if protocolOf(c.Ports[j]) == corev1.ProtocolTCP {
						tcp++
						plan.serverC, plan.server = c, &c.Ports[j]
					}
				}
			}
			if tcp != 1 {
				return nil, refuse(DenyNoUpstreamPort, "name the MCP server's container port %q or annotate the pod %s: \"<port>\" (the pod has %d TCP ports)", PortNameMCP, AnnotationUpstreamPort, tcp)
			}
			plan.upstream = plan.server.ContainerPort
		}
	}

	if plan.server != nil {
		plan.name = plan.server.Name
		plan.hostPort, plan.hostIP = plan.server.HostPort, plan.server.HostIP
	}
	if plan.name == "" {
		if _, p := find(func(p corev1.ContainerPort) bool { return p.Name == PortNameMCP }); p == nil {
			plan.name = PortNameMCP
		}
	}
	if plan.name != "" {
		for _, c := range serving {
			for j := range c.Ports {
				if c.Ports[j].Name == plan.name && &c.Ports[j] != plan.server {
					plan.shadowed = append(plan.shadowed, namedPort{c, j})
				}
			}
		}
	}

	// Every port of every container, host ports included: the sidecar
	// shares the pod's network namespace with all of them.
	used := map[int32]bool{plan.upstream: true}
	for _, c := range allContainers(pod) {
		for _, p := range c.Ports {
			used[p.ContainerPort] = true
			if p.HostPort != 0 {
				used[p.HostPort] = true
			}
		}
	}
	var ok bool
	if plan.proxyPort, ok = freePort(used, cfg.ProxyPort); !ok {
		return nil, refuse(DenyPortCollision, "the pod uses every port from %d on that the sidecar could listen on: free one, or change the manager's --sidecar-port", cfg.ProxyPort)
	}
	used[plan.proxyPort] = true
	if plan.adminPort, ok = freePort(used, cfg.AdminPort); !ok {
		return nil, refuse(DenyPortCollision, "the pod uses every port from %d on that the sidecar's admin endpoint could listen on: free one, or change the manager's --sidecar-admin-port", cfg.AdminPort)
	}
	return plan, nil
}

// freePort is the first port from want on that is not used, within 100.
func freePort(used map[int32]bool, want int32) (int32, bool) {
	for p := want; p < want+100 && p <= 65535; p++ {
		if !used[p] {
			return p, true
		}
	}
	return 0, false
}

// withProtocols is pod with the API server's default protocol filled in,
// for pods that did not come through it.
func withProtocols(pod *corev1.Pod) *corev1.Pod {
	out := pod.DeepCopy()
	for _, c := range allContainers(out) {
		for j := range c.Ports {
			c.Ports[j].Protocol = protocolOf(c.Ports[j])
		}
	}
	return out
}

// apply renames the server's port and the ports that shared its name, and
// moves the server port's hostPort to the sidecar.
func (plan *portPlan) apply() {
	if s := plan.server; s != nil {
		if s.Name != "" && s.Name == plan.name {
			s.Name = PortNameRenamed
			// The kubelet resolves a probe's named port in its own
			// container: the server's probes keep their port by number.
			renamePortRefs(plan.serverC, plan.name, s.ContainerPort)
		}
		s.HostPort, s.HostIP = 0, ""
	}
	for k, sp := range plan.shadowed {
		p := &sp.c.Ports[sp.i]
		renamePortRefs(sp.c, p.Name, p.ContainerPort)
		p.Name = PortNameShadowed + strconv.Itoa(k+1)
	}
}
