package main

import (
	"bytes"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

func medf(xs []float64) float64 { return median(xs) }

// rng is a per-round figure: its median and range over the rounds.
func rng(xs []float64) paired {
	if len(xs) == 0 {
		return paired{math.NaN(), math.NaN(), math.NaN()}
	}
	return paired{median(xs), slices.Min(xs), slices.Max(xs)}
}

func (p paired) String() string {
	if math.IsNaN(p.med) {
		return "-"
	}
	return fmt.Sprintf("%.2f (%.2f-%.2f)", p.med, p.lo, p.hi)
}

// perRound applies f to the rows a and b round by round.
func perRound(a, b *procRow, mode string, f func(a, b *procRow, mode string, i int) float64) paired {
	n := min(len(a.st[mode]), len(b.st[mode]))
	xs := make([]float64, 0, n)
	for i := range n {
		if v := f(a, b, mode, i); !math.IsNaN(v) && !math.IsInf(v, 0) {
			xs = append(xs, v)
		}
	}
	return rng(xs)
}

func (e *procEnv) row(short string) *procRow {
	for _, r := range e.rows {
		if r.short == short {
			return r
		}
	}
	return nil
}

func cpuRatio(a, b *procRow, mode string) paired {
	return perRound(a, b, mode, func(a, b *procRow, mode string, i int) float64 {
		if i >= len(a.cpu[mode]) || i >= len(b.cpu[mode]) {
			return math.NaN()
		}
		return a.cpu[mode][i] / b.cpu[mode][i]
	})
}

func statRatio(f func(stat) float64) func(a, b *procRow, mode string, i int) float64 {
	return func(a, b *procRow, mode string, i int) float64 { return f(a.st[mode][i]) / f(b.st[mode][i]) }
}

func mib(kb float64) float64 { return kb / 1024 }

func (e *procEnv) report(w *bytes.Buffer, c config, conc, chart string) {
	fmt.Fprintf(w, "\n## 0. Headline: every part in its own process\n\n")
	fmt.Fprintf(w, "The load generator (the bench program), the counting MCP server of test/mcpserver (Go SDK, stateless, 2026-07-28),\n")
	fmt.Fprintf(w, "the plain Go proxy (test/bench/cmd/plainproxy), nginx, redis-server and the `idemcp-proxy sidecar` processes (memory\n")
	fmt.Fprintf(w, "store; Redis store; Redis store traced at 100%% sampling, without and with store spans, and at 0%%; Redis store built without tracing code, with\n")
	fmt.Fprintf(w, "the `notracing` build tag) each run in a process of their own. A proxy's CPU is its threads' time on a CPU over the batch\n")
	fmt.Fprintf(w, "(/proc/PID/task/*/schedstat, nanoseconds); peak RSS is its VmHWM at the end of the run. %d rounds; in each, every row runs %d calls\n", e.rounds, c.seqN)
	fmt.Fprintf(w, "from 1 client and %d calls from %d clients, the rows in rotated order. Every figure is the median over the\n", c.procConcN, c.procClients)
	fmt.Fprintf(w, "rounds. The load on this shared machine is in the header; absolute figures move with it, the ratios less so.\n\n")
	fmt.Fprintf(w, "Rows: direct, the Go proxy and nginx call `charge_card` with new arguments each call (the tool runs); the\n")
	fmt.Fprintf(w, "sidecar's passthrough row calls `refund` (a Passthrough tool), executed calls `charge_card` with new arguments,\n")
	fmt.Fprintf(w, "replayed calls it with the same arguments (answered from the store). nginx: %s.\n\n", e.nginxNote)
	if chart != "" {
		fmt.Fprintf(w, "![p50 latency and proxy CPU per 1000 calls](%s)\n\n", filepath.Base(chart))
	}
	for _, mode := range []string{"1", conc} {
		fmt.Fprintf(w, "### %s client(s)\n\n", mode)
		fmt.Fprintf(w, "| path | p50 µs | p99 µs | p99.9 µs | req/s | proxy CPU ms / 1000 calls | peak RSS MiB |\n")
		fmt.Fprintf(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		for _, r := range e.rows {
			if r.large {
				continue
			}
			cpu, rss := "-", "-"
			if r.proxy != nil {
				cpu = fmt.Sprintf("%.0f", medf(r.cpu[mode]))
				rss = fmt.Sprintf("%.1f", mib(memKB(r.proxy.pid(), "VmHWM")))
			}
			s := r.st[mode]
			fmt.Fprintf(w, "| %s | %.0f | %.0f | %.0f | %.0f | %s | %s |\n", r.name, s.med(p50us), s.med(p99us), medf(e.p999[r][mode]), s.med(rps), cpu, rss)
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "### A 1 MiB result, 1 client\n\n`charge_card` padding its result to 1 MiB, %d calls per row per round (1 MiB here is 1,048,576 bytes of padding;\n", c.largeN)
	fmt.Fprintf(w, "the policy's maxResultBytes is 4Mi, so it is stored and replayed). These rows have a Go proxy and a sidecar process of their\n")
	fmt.Fprintf(w, "own, so the stored results do not count in the other rows' peak RSS. Peak RSS here is that of those two processes at the end\n")
	fmt.Fprintf(w, "of the run, the same for both sidecar rows: it holds every 1 MiB result the executed row stored (the memory store keeps\n")
	fmt.Fprintf(w, "them for the policy's ttl); what a call in flight costs is the in-flight goal row below.\n\n")
	fmt.Fprintf(w, "| path | p50 µs | p99 µs | req/s | proxy CPU ms / 1000 calls | peak RSS MiB |\n| --- | ---: | ---: | ---: | ---: | ---: |\n")
	for _, r := range e.rows {
		if !r.large {
			continue
		}
		cpu, rss := "-", "-"
		if r.proxy != nil {
			cpu = fmt.Sprintf("%.0f", medf(r.cpu["1"]))
			rss = fmt.Sprintf("%.1f", mib(memKB(r.proxy.pid(), "VmHWM")))
		}
		s := r.st["1"]
		fmt.Fprintf(w, "| %s | %.0f | %.0f | %.0f | %s | %s |\n", r.name, s.med(p50us), s.med(p99us), s.med(rps), cpu, rss)
	}
	fmt.Fprintln(w)

	e.goalTable(w, c, conc)
	fmt.Fprintf(w, "\n### Data-plane binary\n\nThe same sidecar started from the two binaries of the image, %d times each (figures: median, range):\n\n", len(e.startup))
	fmt.Fprintf(w, "| binary | process start to first served tools/call, ms | idle VmRSS MiB |\n| --- | ---: | ---: |\n")
	for _, b := range []struct {
		name string
		st   []time.Duration
		rss  float64
	}{{"`idemcp-proxy sidecar` (data plane alone; the webhook injects it)", e.startup, e.proxyIdleRSS}, {"`idemcp sidecar` (manager's Kubernetes libraries linked in)", e.fullStartup, e.fullIdleRSS}} {
		ms := make([]float64, len(b.st))
		for i, d := range b.st {
			ms[i] = float64(d) / float64(time.Millisecond)
		}
		r := rng(ms)
		fmt.Fprintf(w, "| %s | %.1f (%.1f-%.1f) | %.1f |\n", b.name, r.med, r.lo, r.hi, mib(b.rss))
	}
	fmt.Fprintf(w, "\nThe sidecar's memory bound over a long run is not measured here: the memory store holds at most\n")
	fmt.Fprintf(w, "`--memory-max-entries` records (section 1b shows the cost as recent calls grow).\n\n")

	fmt.Fprintf(w, "### Duplicate rate: 5 identical calls\n\n| path | calls sent | times the tool ran |\n| --- | ---: | ---: |\n")
	for _, r := range e.dup {
		fmt.Fprintf(w, "| %s | %s | %s |\n", r[0], r[1], r[2])
	}
	fails := 0
	for _, r := range e.rows {
		fails += r.fail
	}
	fmt.Fprintf(w, "\nFailed calls over the whole section (not timed): %d.\n", fails)
}

// chart draws p50 latency and proxy CPU per 1000 calls, per row, at 1 and
// conc clients, side by side.
func (e *procEnv) chart(path, conc string, noise float64) error {
	rows := slices.DeleteFunc(slices.Clone(e.rows), func(r *procRow) bool { return r.large })
	names := make([]string, len(rows))
	for i, r := range rows {
		names[i] = r.short
	}
	bars := func(title, ylabel string, modes []string, f func(r *procRow, mode string) float64) (*plot.Plot, error) {
		p := plot.New()
		p.Title.Text = title
		p.Y.Label.Text = ylabel
		w := vg.Points(9)
		for k, mode := range modes {
			vals := make(plotter.Values, len(rows))
			for i, r := range rows {
				v := f(r, mode)
				if math.IsNaN(v) {
					v = 0
				}
				vals[i] = v
			}
			b, err := plotter.NewBarChart(vals, w)
			if err != nil {
				return nil, err
			}
			b.LineStyle.Width = 0
			if len(modes) > 1 {
				b.Offset = vg.Length(2*k-1) * w / 2
			}
			b.Color = []color.Color{color.RGBA{R: 70, G: 110, B: 180, A: 255}, color.RGBA{R: 220, G: 130, B: 50, A: 255}}[k]
			p.Add(b)
			p.Legend.Add(mode+" client(s)", b)
		}
		p.Legend.Top = true
		p.NominalX(names...)
		p.X.Tick.Label.Rotation = math.Pi / 4
		p.X.Tick.Label.XAlign = draw.XRight
		p.X.Tick.Label.YAlign = draw.YCenter
		p.Add(plotter.NewGrid())
		return p, nil
	}
	lat1, err := bars("p50 latency, 1 client", "µs", []string{"1"}, func(r *procRow, mode string) float64 { return r.st[mode].med(p50us) })
	if err != nil {
		return err
	}
	lat, err := bars("p50 latency, "+conc+" clients", "µs", []string{conc}, func(r *procRow, mode string) float64 { return r.st[mode].med(p50us) })
	if err != nil {
		return err
	}
	cpu, err := bars("proxy CPU per 1000 calls", "ms", []string{"1", conc}, func(r *procRow, mode string) float64 {
		if r.proxy == nil {
			return 0
		}
		return medf(r.cpu[mode])
	})
	if err != nil {
		return err
	}
	goals, err := e.goalChart(conc, noise)
	if err != nil {
		return err
	}
	const top, bottom = 380, 620
	img := vgimg.New(vg.Points(1200), vg.Points(top+bottom))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 3, PadX: vg.Points(10), PadTop: vg.Points(5), PadBottom: vg.Points(5), PadLeft: vg.Points(5), PadRight: vg.Points(5)}
	cs := plot.Align([][]*plot.Plot{{lat1, lat, cpu}}, tiles, draw.Crop(dc, 0, 0, vg.Points(bottom), 0))
	lat1.Draw(cs[0][0])
	lat.Draw(cs[0][1])
	cpu.Draw(cs[0][2])
	goals.Draw(draw.Crop(dc, vg.Points(5), vg.Points(-5), vg.Points(5), vg.Points(-top)))
	f, err := createFile(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

func createFile(path string) (*os.File, error) { return os.Create(path) }
