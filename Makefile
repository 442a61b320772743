# idemcp: make build | test | lint | bench | manifests generate | verify-gen
SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec

IMG ?= ghcr.io/idemcp/idemcp:v0.1.0
CHART_VERSION ?= 0.1.0
# The demo MCP server's image, for make demo on a real cluster.
DEMO_SERVER_IMG ?= ghcr.io/idemcp/idemcp-demo-server:dev
LOCALBIN ?= $(CURDIR)/bin
GO ?= go

CONTROLLER_TOOLS_VERSION ?= v0.23.0
GOLANGCI_LINT_VERSION ?= v2.15.0
KUSTOMIZE_VERSION ?= v5.8.1
HELM_VERSION ?= v3.22.0
# promtool of Prometheus 3.16.0 (the Go module's v0.316.0), for the alert rules;
# built without the service discoveries (remove_all_sd: no cloud SDKs to
# compile), which rule checks and rule tests never use.
PROMTOOL_VERSION ?= v0.316.0
CONTROLLER_GEN ?= $(LOCALBIN)/controller-gen-$(CONTROLLER_TOOLS_VERSION)
GOLANGCI_LINT ?= $(LOCALBIN)/golangci-lint-$(GOLANGCI_LINT_VERSION)
KUSTOMIZE ?= $(LOCALBIN)/kustomize-$(KUSTOMIZE_VERSION)
HELM ?= $(LOCALBIN)/helm-$(HELM_VERSION)
PROMTOOL ?= $(LOCALBIN)/promtool-$(PROMTOOL_VERSION)
KUBECTL ?= kubectl

TS_INTEROP := test/interop/ts

SOAK_DURATION ?= 1h
SOAK_TIMEOUT ?= 3h

VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
LDFLAGS := -X github.com/idemcp/idemcp/internal/version.Version=$(VERSION) -X github.com/idemcp/idemcp/internal/version.Commit=$(COMMIT)

.PHONY: all
all: build

##@ Development

.PHONY: build
build: ## Build bin/idemcp, bin/idemcp-proxy (the data plane alone: sidecar and wrap) and bin/kubectl-idemcp (the kubectl plugin).
	$(GO) build -ldflags "$(LDFLAGS)" -o $(LOCALBIN)/idemcp .
	$(GO) build -ldflags "$(LDFLAGS)" -o $(LOCALBIN)/idemcp-proxy ./cmd/idemcp-proxy
	$(GO) build -ldflags "$(LDFLAGS)" -o $(LOCALBIN)/kubectl-idemcp ./cmd/kubectl-idemcp

.PHONY: fmt
fmt: ## gofmt every Go file.
	$(GO) fmt ./...

.PHONY: vet
vet: ## go vet.
	$(GO) vet ./...

.PHONY: lint
lint: golangci-lint ## Run golangci-lint with .golangci.yml.
	$(GOLANGCI_LINT) run ./...

.PHONY: manifests
manifests: controller-gen ## Write the CRD and the manager's RBAC from the code markers.
	$(CONTROLLER_GEN) rbac:roleName=manager-role crd paths="./api/..." paths="./controllers/..." paths="./webhook/..." paths="./cmd/..." \
		output:crd:artifacts:config=config/crd/bases output:rbac:artifacts:config=config/rbac

.PHONY: generate
generate: controller-gen ## Write zz_generated.deepcopy.go.
	$(CONTROLLER_GEN) object paths="./api/..."

.PHONY: verify-gen
verify-gen: manifests generate installer-files ## Fail if generated files or go.mod are stale.
	$(GO) mod tidy
	@git diff --exit-code -- api config dist go.mod go.sum || { echo "generated files are stale: run 'make manifests generate' and 'go mod tidy' (make verify-gen does all of it), and commit"; exit 1; }

.PHONY: test-deps
test-deps: ## Install what the tests need that Go does not fetch (the npm packages of test/interop/ts: the TypeScript SDK client and the reference MCP servers), again whenever package-lock.json changed.
	@if [ -f $(TS_INTEROP)/package-lock.json ] && ! cmp -s $(TS_INTEROP)/package-lock.json $(TS_INTEROP)/node_modules/.idemcp-installed-lock; then \
		npm ci --prefix $(TS_INTEROP) --no-audit --no-fund && cp $(TS_INTEROP)/package-lock.json $(TS_INTEROP)/node_modules/.idemcp-installed-lock; fi

.PHONY: otlp-receiver
otlp-receiver: ## Build (once, cached outside the checkout) the OTLP receiver the tracing test exports to (hack/otlp-receiver: the Collector's otlpreceiver).
	@hack/setup-otlp-receiver.sh >/dev/null

.PHONY: envtest
envtest: ## Build (once, cached outside the checkout) the kube-apiserver, etcd and kubectl the controller tests run.
	@hack/setup-envtest.sh >/dev/null

.PHONY: test
test: test-deps vet helm promtool ## Run every test: unit, store contract, envtest, and end to end against real MCP servers.
	assets="$$(hack/setup-envtest.sh)"; KUBEBUILDER_ASSETS="$$assets" HELM=$(HELM) PROMTOOL=$(PROMTOOL) $(GO) test -race -count=1 -timeout 40m $$($(GO) list ./... | grep -v -e /test/chaos -e /test/load)
	$(MAKE) chaos

# The inner loop's packages: everything but the suites under test/, which
# are integration suites by nature, plus the test framework's own packages.
UNIT_PKGS = $$($(GO) list ./... | grep -v -e '/test/') ./test/history ./test/poll ./test/procs ./test/testdeps

.PHONY: test-unit
test-unit: ## The inner loop: go test -short, which leaves out every test that starts a real process (redis-server, PostgreSQL, a built binary, envtest); make test runs those.
	$(GO) test -short $(UNIT_PKGS)

.PHONY: demo
demo: build ## Show idemcp's main job on a local control plane: injection, 5 retries -> 1 charge, a live policy change (about a minute; the first run builds kube-apiserver, 5-10 minutes). With KUBECONFIG=... on the command line: on that real cluster, with the images IMG and DEMO_SERVER_IMG (make demo-images).
ifeq ($(origin KUBECONFIG),command line)
	$(GO) run ./test/demo --cluster "$(KUBECONFIG)" --image $(IMG) --server-image $(DEMO_SERVER_IMG)
else
	@assets="$$(hack/setup-envtest.sh)"; $(GO) run ./test/demo --idemcp $(LOCALBIN)/idemcp --assets "$$assets"
endif

.PHONY: demo-images
demo-images: image ## Write the images make demo KUBECONFIG=... runs: dist/idemcp-image.tar (IMG) and dist/idemcp-demo-server.tar (DEMO_SERVER_IMG).
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) build -trimpath -ldflags "-s -w" -o $(LOCALBIN)/linux-amd64/idemcp-demo-server ./test/demo
	$(GO) run ./hack/image --app $(LOCALBIN)/linux-amd64/idemcp-demo-server --image $(DEMO_SERVER_IMG) --out dist/idemcp-demo-server.tar
	@echo "load both into the cluster (kind load image-archive, ctr -n k8s.io images import) or push them, then: make demo KUBECONFIG=... IMG=$(IMG) DEMO_SERVER_IMG=$(DEMO_SERVER_IMG)"

.PHONY: chaos
chaos: ## The chaos tests (3 sidecars; a real Redis, a Sentinel pair, a fault proxy, a PostgreSQL primary and standby, a stepping clock; injected faults; about 5 minutes), printing their counts.
	$(GO) test -race -count=1 -timeout 20m -v -run 'TestChaos' ./test/chaos/ | grep -v '^=== '

SEEDS ?= $(shell seq 1 20)
.PHONY: chaos-sentinel-seeds
chaos-sentinel-seeds: ## The Sentinel failover chaos section once per seed (SEEDS, default 1..20; about a minute each), recorded by seed in test/chaos/results.md, the whole output of a failed seed kept in bin/chaos-seeds; fails if any seed failed.
	@mkdir -p $(LOCALBIN)/chaos-seeds; log=$$(mktemp); failed=""; for seed in $(SEEDS); do \
		echo "== seed $$seed"; \
		if CHAOS_SEED=$$seed CHAOS_RECORD_SEEDS=1 $(GO) test -race -count=1 -timeout 10m -v -run '^TestChaosSentinelFailover$$' ./test/chaos/ >$$log 2>&1; then :; else \
			failed="$$failed $$seed"; cp $$log $(LOCALBIN)/chaos-seeds/seed-$$seed.log; \
			grep -E -e '^\s+chaos_test.go:[0-9]+: [^0-9]' $$log | grep -v -e ' fault: ' -e 'chaos: seed' -e 'verification took' | tail -20; \
		fi; \
		grep -E -e '^(--- |FAIL|ok )' -e 'must be 0' $$log || true; \
	done; rm -f $$log; \
	if [ -n "$$failed" ]; then echo "failed seeds:$$failed (logs in $(LOCALBIN)/chaos-seeds)"; exit 1; fi

.PHONY: chaos-record
chaos-record: ## Run the chaos tests (part of make test) and record their counts in test/chaos/results.md.
	CHAOS_RECORD=1 $(GO) test -race -count=1 -timeout 20m -v -run 'TestChaos' ./test/chaos/ | grep -v '^=== '

.PHONY: load
load: ## 1,000 concurrent sessions for 60s through one sidecar process on a real Redis: no errors, no duplicates, memory flat after warm-up (about 2 minutes; LOAD_DURATION, LOAD_SESSIONS).
	$(GO) test -count=1 -timeout 10m -v -run TestLoad ./test/load/ | grep -v '^=== '

.PHONY: soak
soak: ## Mixed traffic at a bounded rate through 2 sidecars and a real Redis for SOAK_DURATION (default 1h; SOAK_RATE calls/s, default 20; SOAK_DROPS, default 0.03), checking the guarantees and flat memory; records test/soak/results.md.
	cd test/soak && SOAK_RECORD=1 SOAK_DURATION=$(SOAK_DURATION) $(GO) test -tags soak -count=1 -timeout $(SOAK_TIMEOUT) -v -run TestSoak . | grep -v '^=== '

.PHONY: fuzz
fuzz: ## Run every Go fuzz target for FUZZTIME each (default 10s); seeds in testdata/fuzz.
	hack/fuzz.sh

.PHONY: bench
bench: ## Measure the sidecar (own process) against direct, a Go proxy and nginx in the same run; and the policy push to 100, 1000 and 10,000 sidecars; repeats rounds until the headline ratios settle (±15%) or -proc-max-rounds; writes test/bench/results.md and results.png with the goal table (on a quiet machine; longer on a loaded one). BENCH_ARGS="-proc-rounds=1 -proc-max-rounds=1" for a quick run.
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { echo "bench: installing Debian's nginx-light for the nginx baseline"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y nginx-light || { $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update && $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y nginx-light; }; }
	$(GO) run ./test/bench -out test/bench/results.md $(BENCH_ARGS)
	assets="$$(hack/setup-envtest.sh)"; KUBEBUILDER_ASSETS="$$assets" $(GO) run ./test/bench/push -out test/bench/results.md

.PHONY: e2e-build
e2e-build: ## Build (once, cached in ~/.local/share/idemcp) the real-node e2e cluster's binaries: Kubernetes 1.37 and containerd 2.4 from Go modules (20-30 minutes cold).
	@hack/realnode/build.sh >/dev/null

.PHONY: e2e-up
e2e-up: ## Start a single-node Kubernetes cluster (no Docker) inside the network namespace idemcp-e2e; make e2e-down stops it.
	hack/realnode/up.sh

.PHONY: e2e-down
e2e-down: ## Stop the e2e cluster and remove everything it made outside the build cache.
	hack/realnode/down.sh

.PHONY: test-e2e
test-e2e: ## Real-node e2e: cluster up, idemcp installed from dist/install.yaml, the suite (test/realnode), teardown even on failure (root; see docs/e2e.md).
	hack/realnode/test.sh

##@ Build

.PHONY: build-linux
build-linux: ## Build the static linux/amd64 binaries the image holds (bin/linux-amd64/idemcp and idemcp-proxy), as the Dockerfile does.
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) build -trimpath -ldflags "-s -w $(LDFLAGS)" -o $(LOCALBIN)/linux-amd64/idemcp .
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) build -trimpath -ldflags "-s -w $(LDFLAGS)" -o $(LOCALBIN)/linux-amd64/idemcp-proxy ./cmd/idemcp-proxy

PLUGIN_PLATFORMS ?= linux/amd64 linux/arm64 darwin/amd64 darwin/arm64
PLUGIN_VERSION ?= v$(CHART_VERSION)

.PHONY: plugin-dist
plugin-dist: ## Write the kubectl plugin's static release tarballs dist/plugin/kubectl-idemcp_OS_ARCH.tar.gz and their krew manifest dist/plugin/idemcp.yaml (from config/krew).
	@rm -rf dist/plugin && mkdir -p dist/plugin
	@manifest=$$(sed -e '/^#/d' -e 's/PLUGIN_VERSION/$(PLUGIN_VERSION)/g' config/krew/idemcp.yaml); \
	for p in $(PLUGIN_PLATFORMS); do os=$${p%/*}; arch=$${p#*/}; dir=$$(mktemp -d); \
	  echo "building kubectl-idemcp for $$os/$$arch"; \
	  CGO_ENABLED=0 GOOS=$$os GOARCH=$$arch $(GO) build -trimpath -ldflags "-s -w $(LDFLAGS)" -o $$dir/kubectl-idemcp ./cmd/kubectl-idemcp; \
	  cp LICENSE $$dir/; tar -C $$dir -czf dist/plugin/kubectl-idemcp_$${os}_$${arch}.tar.gz kubectl-idemcp LICENSE; rm -rf $$dir; \
	  sum=$$(sha256sum dist/plugin/kubectl-idemcp_$${os}_$${arch}.tar.gz | cut -d' ' -f1); \
	  manifest=$$(printf '%s\n' "$$manifest" | sed "s/SHA256_$${os}_$${arch}/$$sum/"); \
	done; \
	printf '%s\n' "$$manifest" > dist/plugin/idemcp.yaml
	@echo "wrote dist/plugin; install from it with: kubectl krew install --manifest=dist/plugin/idemcp.yaml --archive=dist/plugin/kubectl-idemcp_linux_amd64.tar.gz"

.PHONY: image
image: build-linux ## Write the image IMG as a tarball, dist/idemcp-image.tar, with no Docker engine.
	@mkdir -p dist
	$(GO) run ./hack/image --binary $(LOCALBIN)/linux-amd64/idemcp --proxy-binary $(LOCALBIN)/linux-amd64/idemcp-proxy --image $(IMG) --out dist/idemcp-image.tar
	@echo "wrote dist/idemcp-image.tar ($(IMG)); load it with ctr -n k8s.io images import or kind load image-archive, or push it with make image-push"

.PHONY: image-push
image-push: build-linux ## Write dist/idemcp-image.tar and push IMG to its registry (credentials of docker login), with no Docker engine.
	@mkdir -p dist
	$(GO) run ./hack/image --binary $(LOCALBIN)/linux-amd64/idemcp --proxy-binary $(LOCALBIN)/linux-amd64/idemcp-proxy --image $(IMG) --out dist/idemcp-image.tar --push

.PHONY: docker-build
docker-build: ## Build the image IMG with Docker (needs a Docker engine; `make image` needs none).
	docker build -t $(IMG) .

.PHONY: docker-push
docker-push: ## Push IMG with Docker.
	docker push $(IMG)

.PHONY: build-installer
build-installer: kustomize ## Write dist/install.yaml (CRD, RBAC, manager, webhook) with the image IMG.
	@rm -rf dist/.overlay && mkdir -p dist/.overlay
	@printf 'resources:\n- ../../config/default\n' > dist/.overlay/kustomization.yaml
	cd dist/.overlay && $(KUSTOMIZE) edit set image ghcr.io/idemcp/idemcp=$(IMG)
	$(KUSTOMIZE) build dist/.overlay > dist/install.yaml
	@rm -rf dist/.overlay
	@echo "wrote dist/install.yaml with image $(IMG)"

.PHONY: monitoring
monitoring: ## Write the Grafana dashboard config/monitoring/grafana-dashboard.json (hack/dashboard).
	$(GO) run ./hack/dashboard -out config/monitoring/grafana-dashboard.json

.PHONY: helm-chart
helm-chart: kustomize monitoring ## Write the Helm chart dist/chart from config/default (CRDs in crds/, image and replicas as values) and config/monitoring (monitoring.* values, off by default).
	@mon=$$(mktemp); trap 'rm -f $$mon' EXIT; $(KUSTOMIZE) build config/monitoring > $$mon; \
	$(KUSTOMIZE) build config/default | $(GO) run ./hack/helmchart -out dist/chart -version $(CHART_VERSION) -monitoring $$mon

.PHONY: helm-lint
helm-lint: helm helm-chart ## helm lint the chart.
	$(HELM) lint dist/chart

.PHONY: installer-files
installer-files: ## Regenerate the committed dist/install.yaml (default IMG) and dist/chart.
	$(MAKE) build-installer IMG=ghcr.io/idemcp/idemcp:v$(CHART_VERSION)
	$(MAKE) helm-chart

##@ Deployment

.PHONY: deploy
deploy: build-installer ## Install idemcp with the image IMG into the cluster of the current kubectl context.
	$(KUBECTL) apply --server-side -f dist/install.yaml

.PHONY: undeploy
undeploy: build-installer ## Remove idemcp: the webhook first, so no pod create waits on a manager that is going away.
	-$(KUBECTL) delete mutatingwebhookconfiguration -l app.kubernetes.io/part-of=idemcp --ignore-not-found
	$(KUBECTL) delete --ignore-not-found -f dist/install.yaml

##@ Tools

# Pinned tools live in bin/, copied from a cache outside the checkout
# (hack/tool.sh; IDEMCP_TOOL_CACHE), so that a fresh clone builds none again.

.PHONY: controller-gen
controller-gen: $(CONTROLLER_GEN)
$(CONTROLLER_GEN):
	GO=$(GO) hack/tool.sh $@ sigs.k8s.io/controller-tools/cmd/controller-gen $(CONTROLLER_TOOLS_VERSION) controller-gen

.PHONY: golangci-lint
golangci-lint: $(GOLANGCI_LINT)
$(GOLANGCI_LINT):
	GO=$(GO) hack/tool.sh $@ github.com/golangci/golangci-lint/v2/cmd/golangci-lint $(GOLANGCI_LINT_VERSION) golangci-lint

.PHONY: kustomize
kustomize: $(KUSTOMIZE)
$(KUSTOMIZE):
	GO=$(GO) hack/tool.sh $@ sigs.k8s.io/kustomize/kustomize/v5 $(KUSTOMIZE_VERSION) kustomize

.PHONY: helm
helm: $(HELM)
$(HELM):
	GO=$(GO) hack/tool.sh $@ helm.sh/helm/v3/cmd/helm $(HELM_VERSION) helm

.PHONY: promtool
promtool: $(PROMTOOL)
$(PROMTOOL):
	GO=$(GO) TOOL_TAGS=remove_all_sd hack/tool.sh $@ github.com/prometheus/prometheus/cmd/promtool $(PROMTOOL_VERSION) promtool

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"} /^[a-zA-Z_-]+:.*?##/ { printf "  %-14s %s\n", $$1, $$2 } /^##@/ { printf "\n%s\n", substr($$0, 5) }' $(MAKEFILE_LIST)
