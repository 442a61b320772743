# One image for every role: manager, sidecar and wrap.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY main.go ./
COPY api/ api/
COPY controllers/ controllers/
COPY sidecar/ sidecar/
COPY webhook/ webhook/
ARG TARGETOS=linux
ARG TARGETARCH=amd64
RUN CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} go build -trimpath -ldflags="-s -w" -o /out/idemcp .

FROM gcr.io/distroless/static:nonroot
COPY --from=build /out/idemcp /idemcp
USER 65532:65532
ENTRYPOINT ["/idemcp"]
