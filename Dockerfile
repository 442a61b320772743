# One image for every role: /idemcp (manager, sidecar and wrap) and /idemcp-proxy
# (sidecar and wrap only, without the manager's Kubernetes libraries: the
# webhook injects it), built from the same sources.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY main.go ./
COPY api/ api/
COPY cmd/ cmd/
COPY controllers/ controllers/
COPY internal/ internal/
COPY sidecar/ sidecar/
COPY webhook/ webhook/
ARG TARGETOS=linux
ARG TARGETARCH=amd64
RUN CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} go build -trimpath -ldflags="-s -w" -o /out/idemcp . && \
    CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} go build -trimpath -ldflags="-s -w" -o /out/idemcp-proxy ./cmd/idemcp-proxy

FROM gcr.io/distroless/static:nonroot
COPY --from=build /out/idemcp /idemcp
COPY --from=build /out/idemcp-proxy /idemcp-proxy
USER 65532:65532
ENTRYPOINT ["/idemcp"]
