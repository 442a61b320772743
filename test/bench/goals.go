package main

import (
	"bytes"
	"fmt"
	"image/color"
	"math"
	"slices"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// The goals of the separate-process section, as the issue states them:
// each is a figure of this run against a bound, and its verdict is "met",
// "not met", or "noisy" when the figure moved too much over the rounds to
// tell.

type bound int

const (
	atMost  bound = iota // figure ≤ bound
	below                // figure < bound
	atLeast              // figure ≥ bound
)

type goalRow struct {
	goal   string
	figure string
	short  string // label in the chart
	p      paired
	limit  float64
	kind   bound
	// spread: p has a range over rounds (or repetitions), so a wide one
	// makes it noisy; headline: it decides when the rounds stop.
	spread, headline bool
}

func single(x float64) paired { return paired{x, x, x} }

// within says whether p's range stays within noise of its median.
func within(p paired, noise float64) bool {
	m := math.Abs(p.med)
	return p.hi-p.med <= noise*m && p.med-p.lo <= noise*m
}

func (g goalRow) met() bool {
	switch g.kind {
	case below:
		return g.p.med < g.limit
	case atLeast:
		return g.p.med >= g.limit
	default:
		return g.p.med <= g.limit
	}
}

func (g goalRow) verdict(noise float64) string {
	switch {
	case math.IsNaN(g.p.med):
		return "not measurable this run"
	case g.spread && !within(g.p, noise):
		return "noisy"
	case g.met():
		return "met"
	default:
		return "not met"
	}
}

func (g goalRow) bound() string {
	return [...]string{"≤ ", "< ", "≥ "}[g.kind] + fmt.Sprintf("%g", g.limit)
}

// addedOver: the latency row a adds over base, divided by what row b adds
// over base, at p50, in the same round.
func addedOver(base, a, b *procRow, mode string) paired {
	if base == nil || a == nil || b == nil {
		return paired{math.NaN(), math.NaN(), math.NaN()}
	}
	return perRound(a, b, mode, func(a, b *procRow, mode string, i int) float64 {
		if i >= len(base.st[mode]) {
			return math.NaN()
		}
		d := base.st[mode][i].p50
		if b.st[mode][i].p50 <= d {
			return math.NaN() // the baseline added nothing this round: no ratio
		}
		return float64(a.st[mode][i].p50-d) / float64(b.st[mode][i].p50-d)
	})
}

func (e *procEnv) goals(conc string) []goalRow {
	d, gp, ng := e.row("direct"), e.row("Go proxy"), e.row("nginx")
	ex, pass, rep := e.row("exec memory"), e.row("pass memory"), e.row("replay memory")
	var gs []goalRow
	add := func(g goalRow) { gs = append(gs, g) }
	for _, mode := range []string{"1", conc} {
		add(goalRow{goal: "executed call: added p50 ≤ 0.5x the Go proxy's", figure: "added p50 over direct, executed / Go proxy, " + mode + " client(s)",
			short: "exec added p50 /Go @" + mode, p: addedOver(d, ex, gp, mode), limit: 0.5, spread: true, headline: true})
		add(goalRow{goal: "executed call: CPU per call ≤ 0.5x the Go proxy's", figure: "CPU per call, executed / Go proxy, " + mode + " client(s)",
			short: "exec CPU /Go @" + mode, p: cpuRatio(ex, gp, mode), limit: 0.5, spread: true, headline: true})
		if ng != nil {
			add(goalRow{goal: "(aim) executed call: added p50 ≤ nginx's", figure: "added p50 over direct, executed / nginx, " + mode + " client(s)",
				short: "exec added p50 /nginx @" + mode, p: addedOver(d, ex, ng, mode), limit: 1, spread: true})
			add(goalRow{goal: "(aim) executed call: CPU per call ≤ nginx's", figure: "CPU per call, executed / nginx, " + mode + " client(s)",
				short: "exec CPU /nginx @" + mode, p: cpuRatio(ex, ng, mode), limit: 1, spread: true})
		}
	}
	add(goalRow{goal: "throughput at " + conc + " clients ≥ 1.2x the Go proxy's", figure: "req/s, executed / Go proxy, " + conc + " clients",
		short: "exec req/s /Go @" + conc, p: perRound(ex, gp, conc, statRatio(rps)), limit: 1.2, kind: atLeast, spread: true, headline: true})
	if ng != nil {
		add(goalRow{goal: "(aim) throughput at " + conc + " clients ≥ nginx's", figure: "req/s, executed / nginx, " + conc + " clients",
			short: "exec req/s /nginx @" + conc, p: perRound(ex, ng, conc, statRatio(rps)), limit: 1, kind: atLeast, spread: true})
	}
	for _, mode := range []string{"1", conc} {
		for _, f := range []struct {
			name     string
			p        paired
			kind     bound
			headline bool
		}{
			{"p50", perRound(pass, gp, mode, statRatio(p50us)), atMost, true},
			{"p99", perRound(pass, gp, mode, statRatio(p99us)), atMost, false},
			{"req/s", perRound(pass, gp, mode, statRatio(rps)), atLeast, true},
			{"CPU per call", cpuRatio(pass, gp, mode), atMost, true},
		} {
			add(goalRow{goal: "passthrough: ≤ the Go proxy on every figure", figure: f.name + ", passthrough / Go proxy, " + mode + " client(s)",
				short: "pass " + f.name + " /Go @" + mode, p: f.p, limit: 1, kind: f.kind, spread: true, headline: f.headline})
		}
	}
	if traced, off := e.row("exec redis traced"), e.row("exec redis"); traced != nil && off != nil {
		for _, mode := range []string{"1", conc} {
			add(goalRow{goal: "tracing on (100% sampled): CPU per executed call < 1.10x off", figure: "CPU per call, executed redis traced / untraced, " + mode + " client(s)",
				short: "traced CPU /untraced @" + mode, p: cpuRatio(traced, off, mode), limit: 1.10, kind: below, spread: true})
			add(goalRow{goal: "(aim) tracing on: p50 < 1.10x off", figure: "p50, executed redis traced / untraced, " + mode + " client(s)",
				short: "traced p50 /untraced @" + mode, p: perRound(traced, off, mode, statRatio(p50us)), limit: 1.10, kind: below, spread: true})
		}
	}
	// What store spans (spec.tracing.storeSpans, off by default) add.
	if spans, off := e.row("exec redis store spans"), e.row("exec redis"); spans != nil && off != nil {
		for _, mode := range []string{"1", conc} {
			add(goalRow{goal: "(aim) tracing on with store spans: CPU per executed call < 1.10x off", figure: "CPU per call, executed redis traced with store spans / untraced, " + mode + " client(s)",
				short: "store spans CPU /untraced @" + mode, p: cpuRatio(spans, off, mode), limit: 1.10, kind: below, spread: true})
		}
	}
	if off, none := e.row("exec redis"), e.row("exec redis notracing"); off != nil && none != nil {
		for _, mode := range []string{"1", conc} {
			add(goalRow{goal: "tracing off costs nothing measurable", figure: "CPU per call, executed redis, tracing off / built without tracing code, " + mode + " client(s)",
				short: "off CPU /no tracing @" + mode, p: cpuRatio(off, none, mode), limit: 1.05, kind: atMost, spread: true})
		}
	}
	// What a call the sampler drops costs over tracing off.
	if unsampled, off := e.row("exec redis unsampled"), e.row("exec redis"); unsampled != nil && off != nil {
		for _, mode := range []string{"1", conc} {
			add(goalRow{goal: "tracing on, 0% sampled: CPU per executed call ≤ 1.05x off", figure: "CPU per call, executed redis 0% sampled / untraced, " + mode + " client(s)",
				short: "unsampled CPU /untraced @" + mode, p: cpuRatio(unsampled, off, mode), limit: 1.05, kind: atMost, spread: true})
		}
	}
	rssPass := mib(memKB(e.sideMem.pid(), "VmHWM")) / mib(memKB(e.plain.pid(), "VmHWM"))
	add(goalRow{goal: "passthrough: ≤ the Go proxy on every figure", figure: "peak RSS, sidecar (memory) / Go proxy", short: "sidecar RSS /Go", p: single(rssPass), limit: 1})
	for _, mode := range []string{"1", conc} {
		add(goalRow{goal: "a replay is faster than a direct call", figure: "p50, replayed / direct, " + mode + " client(s)",
			short: "replay p50 /direct @" + mode, p: perRound(rep, d, mode, statRatio(p50us)), limit: 1, kind: below, spread: true})
	}
	ping := rng(e.pingGapped)
	for _, r := range []struct {
		goal  string
		a, b  *procRow
		limit float64
	}{{"Redis store: executed path ≤ 2 PING round trips over memory", e.row("exec redis"), ex, 2}, {"Redis store: replay ≤ 1 PING round trip over memory", e.row("replay redis"), rep, 1}} {
		trips := perRound(r.a, r.b, "1", func(a, b *procRow, mode string, i int) float64 {
			if len(e.pingGapped) == 0 {
				return math.NaN()
			}
			return diffP50(a.st[mode][i], b.st[mode][i]) / e.pingGapped[min(i, len(e.pingGapped)-1)]
		})
		add(goalRow{goal: r.goal, figure: fmt.Sprintf("(p50 %s − %s) / PING p50 with %v between PINGs in the same rounds (%.0f µs; back to back: %.0f µs), 1 client",
			r.a.short, r.b.short, pingGap, ping.med, medf(e.pingHot)), short: r.a.short + " PINGs", p: trips, limit: r.limit, spread: true, headline: true})
	}
	add(goalRow{goal: "Redis store: executed path ≤ 2 PING round trips over memory", figure: "Redis commands per executed call, counted with MONITOR (a script's own commands excluded), 50 calls",
		short: "Redis cmds exec", p: single(e.redisPerCall[0]), limit: 2})
	add(goalRow{goal: "Redis store: replay ≤ 1 PING round trip over memory", figure: "Redis commands per replayed call, counted the same way",
		short: "Redis cmds replay", p: single(e.redisPerCall[1]), limit: 1})
	ld, lg, le, lr := e.row("direct 1MiB"), e.row("Go proxy 1MiB"), e.row("exec memory 1MiB"), e.row("replay memory 1MiB")
	add(goalRow{goal: "1 MiB result, executed: added p50 ≤ the Go proxy's", figure: "added p50 over direct, executed / Go proxy, 1 MiB result, 1 client",
		short: "1MiB exec added /Go", p: addedOver(ld, le, lg, "1"), limit: 1, spread: true, headline: true})
	var lrep paired
	if lr != nil && ld != nil {
		lrep = perRound(lr, ld, "1", statRatio(p50us))
	} else {
		lrep = paired{math.NaN(), math.NaN(), math.NaN()}
	}
	add(goalRow{goal: "1 MiB result, replayed: faster than direct", figure: "p50, replayed / direct, 1 MiB result, 1 client",
		short: "1MiB replay /direct", p: lrep, limit: 1, kind: below, spread: true, headline: true})
	perCall := rng(e.inFlightKB)
	add(goalRow{goal: "1 MiB result: sidecar's extra RSS per call in flight ≤ 1.5x the result",
		figure: fmt.Sprintf("(peak − idle VmRSS) / %d calls in flight / 1 MiB, Redis store, %d fresh sidecars", e.inFlightK, len(e.inFlightKB)),
		short:  "1MiB RSS per call", p: paired{perCall.med / 1024, perCall.lo / 1024, perCall.hi / 1024}, limit: 1.5, spread: true})
	idle := mib(e.idleRSS)
	add(goalRow{goal: "sidecar RSS idle < 20 MiB", figure: fmt.Sprintf("VmRSS %.1f MiB / 20 MiB (of it %.1f MiB private, RssAnon; the rest file pages, mostly the binary's, shared on a node by every sidecar of the image)", idle, mib(e.idleAnon)), short: "idle RSS /20MiB", p: single(idle / 20), limit: 1, kind: below})
	sess := mib(e.sessRSS)
	add(goalRow{goal: fmt.Sprintf("sidecar RSS with %d sessions < 100 MiB", e.sessions), figure: fmt.Sprintf("VmRSS %.1f MiB (peak %.1f) / 100 MiB", sess, mib(e.sessPeak)),
		short: "sessions RSS /100MiB", p: single(sess / 100), limit: 1, kind: below})
	su := make([]float64, len(e.startup))
	for i, s := range e.startup {
		su[i] = float64(s) / float64(time.Millisecond) / 50
	}
	add(goalRow{goal: "startup < 50 ms", figure: fmt.Sprintf("process start to first served tools/call / 50 ms, %d starts", len(su)), short: "startup /50ms", p: rng(su), limit: 1, kind: below})
	return gs
}

// unsettled names the headline ratios whose range is still wider than
// the noise bound.
func (e *procEnv) unsettled(c config, conc string) []string {
	var wide []string
	for _, g := range e.goals(conc) {
		if g.headline && !math.IsNaN(g.p.med) && !within(g.p, c.noise) {
			wide = append(wide, fmt.Sprintf("%s %s", g.short, g.p))
		}
	}
	return wide
}

func (e *procEnv) goalTable(w *bytes.Buffer, c config, conc string) {
	fmt.Fprintf(w, "### Goals\n\n")
	stop := fmt.Sprintf("every headline ratio's range was within ±%.0f%% of its median", 100*c.noise)
	if !e.settled {
		stop = fmt.Sprintf("the round limit (%d) was reached with some headline ratio's range wider than ±%.0f%%", c.procMaxRounds, 100*c.noise)
	}
	fmt.Fprintf(w, "%d rounds (at least %d, at most %d): the rounds stopped because %s.\n", e.rounds, c.procRounds, c.procMaxRounds, stop)
	fmt.Fprintf(w, "A ratio is the median over the rounds of that round's ratio, its range in brackets; a figure whose range reaches\n")
	fmt.Fprintf(w, "further than ±%.0f%% from its median is **noisy**: this run cannot tell whether it meets its goal. Load average\n", 100*c.noise)
	fmt.Fprintf(w, "at the start and at the end of the run is in the header and the footer; above 2 on this 2-core machine, trust no verdict.\n\n")
	fmt.Fprintf(w, "| goal | figure | median (range) | goal | verdict |\n| --- | --- | ---: | ---: | --- |\n")
	for _, g := range e.goals(conc) {
		v := g.verdict(c.noise)
		if v != "met" {
			v = "**" + v + "**"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s |\n", g.goal, g.figure, g.p, g.bound(), v)
	}
	fmt.Fprintf(w, "\nThe policy push goals (p99 < 1 s to 10,000 sidecars, manager ≤ 40 KiB per stream, all reconnected within\n")
	fmt.Fprintf(w, "60 s after a manager failover) are in the Policy push section's own goal table, written by `test/bench/push`.\n\n")
}

// goalChart draws every goal's figure over its bound (for a "≥" goal, the
// bound over the figure), so that left of 1 is met: the median as a bar,
// the range as two ticks, the colour the verdict.
const chartMax = 3

func (e *procEnv) goalChart(conc string, noise float64) (*plot.Plot, error) {
	gs := slices.DeleteFunc(e.goals(conc), func(g goalRow) bool { return math.IsNaN(g.p.med) || g.limit == 0 })
	p := plot.New()
	p.Title.Text = "goals: figure / goal (≥ goals: goal / figure); left of 1 is met; green met, red not met, grey noisy"
	p.X.Label.Text = "ratio to the goal"
	names := make([]string, len(gs))
	var ends plotter.XYs
	for i, g := range gs {
		names[i] = g.short
		// Clipped at chartMax, so that one far-off figure leaves the
		// others readable.
		norm := func(x float64) float64 {
			if g.kind == atLeast {
				x = g.limit / x
			} else {
				x /= g.limit
			}
			return math.Min(x, chartMax)
		}
		b, err := plotter.NewBarChart(plotter.Values{math.Max(0, norm(g.p.med))}, vg.Points(8))
		if err != nil {
			return nil, err
		}
		b.Horizontal = true
		b.XMin = float64(i)
		b.LineStyle.Width = 0
		switch g.verdict(noise) {
		case "met":
			b.Color = color.RGBA{R: 60, G: 160, B: 80, A: 255}
		case "not met":
			b.Color = color.RGBA{R: 200, G: 60, B: 50, A: 255}
		default:
			b.Color = color.RGBA{R: 150, G: 150, B: 150, A: 255}
		}
		p.Add(b)
		if g.spread {
			ends = append(ends, plotter.XY{X: norm(g.p.lo), Y: float64(i)}, plotter.XY{X: norm(g.p.hi), Y: float64(i)})
		}
	}
	if len(ends) > 0 {
		s, err := plotter.NewScatter(ends)
		if err != nil {
			return nil, err
		}
		s.Shape = draw.PlusGlyph{}
		p.Add(s)
	}
	one, err := plotter.NewLine(plotter.XYs{{X: 1, Y: -0.5}, {X: 1, Y: float64(len(gs)) - 0.5}})
	if err != nil {
		return nil, err
	}
	one.Dashes = []vg.Length{vg.Points(3), vg.Points(3)}
	p.Add(one)
	p.NominalY(names...)
	p.X.Min, p.X.Max = 0, chartMax
	p.Add(plotter.NewGrid())
	return p, nil
}
