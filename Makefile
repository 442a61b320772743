# idemcp: make build | test | lint | bench | manifests generate | verify-gen
SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec

IMG ?= ghcr.io/idemcp/idemcp:dev
LOCALBIN ?= $(CURDIR)/bin
GO ?= go

CONTROLLER_TOOLS_VERSION ?= v0.23.0
GOLANGCI_LINT_VERSION ?= v2.15.0
CONTROLLER_GEN ?= $(LOCALBIN)/controller-gen-$(CONTROLLER_TOOLS_VERSION)
GOLANGCI_LINT ?= $(LOCALBIN)/golangci-lint-$(GOLANGCI_LINT_VERSION)

TS_INTEROP := test/interop/ts

.PHONY: all
all: build

##@ Development

.PHONY: build
build: ## Build bin/idemcp.
	$(GO) build -o $(LOCALBIN)/idemcp .

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
	$(CONTROLLER_GEN) rbac:roleName=manager-role crd paths="./api/..." paths="./controllers/..." paths="./webhook/..." \
		output:crd:artifacts:config=config/crd/bases output:rbac:artifacts:config=config/rbac

.PHONY: generate
generate: controller-gen ## Write zz_generated.deepcopy.go.
	$(CONTROLLER_GEN) object paths="./api/..."

.PHONY: verify-gen
verify-gen: manifests generate ## Fail if generated files or go.mod are stale.
	$(GO) mod tidy
	@git diff --exit-code -- api config go.mod go.sum || { echo "generated files are stale: run 'make manifests generate' and 'go mod tidy', and commit"; exit 1; }

.PHONY: test-deps
test-deps: ## Install what the tests need that Go does not fetch (npm packages of the TypeScript interop client).
	@if [ -f $(TS_INTEROP)/package-lock.json ] && [ ! -d $(TS_INTEROP)/node_modules ]; then \
		npm ci --prefix $(TS_INTEROP) --no-audit --no-fund; fi

.PHONY: envtest
envtest: ## Build (once, cached outside the checkout) the kube-apiserver, etcd and kubectl the controller tests run.
	@hack/setup-envtest.sh >/dev/null

.PHONY: test
test: test-deps vet ## Run every test: unit, store contract, envtest, and end to end against real MCP servers.
	assets="$$(hack/setup-envtest.sh)"; KUBEBUILDER_ASSETS="$$assets" $(GO) test -race -count=1 ./...

.PHONY: bench
bench: ## Measure the sidecar and `idemcp wrap` against same-run baselines; writes test/bench/results.md (1-2 minutes).
	$(GO) run ./test/bench -out test/bench/results.md

##@ Build

.PHONY: docker-build
docker-build: ## Build the image (needs a Docker engine).
	docker build -t $(IMG) .

##@ Tools

.PHONY: controller-gen
controller-gen: $(CONTROLLER_GEN)
$(CONTROLLER_GEN):
	GOBIN=$(LOCALBIN) $(GO) install sigs.k8s.io/controller-tools/cmd/controller-gen@$(CONTROLLER_TOOLS_VERSION)
	mv $(LOCALBIN)/controller-gen $@

.PHONY: golangci-lint
golangci-lint: $(GOLANGCI_LINT)
$(GOLANGCI_LINT):
	GOBIN=$(LOCALBIN) $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)
	mv $(LOCALBIN)/golangci-lint $@

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"} /^[a-zA-Z_-]+:.*?##/ { printf "  %-14s %s\n", $$1, $$2 } /^##@/ { printf "\n%s\n", substr($$0, 5) }' $(MAKEFILE_LIST)
