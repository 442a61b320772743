package main

import (
	"math"
	"slices"
	"time"
)

// batch is one timed run of one scenario against one target.
type batch struct {
	lat     []time.Duration // one per request
	elapsed time.Duration   // wall time of the whole batch
}

// stat summarises a batch.
type stat struct {
	p50, p90, p99 time.Duration
	rps           float64
}

func (b batch) stat() stat {
	s := slices.Clone(b.lat)
	slices.Sort(s)
	return stat{
		p50: percentile(s, 0.50),
		p90: percentile(s, 0.90),
		p99: percentile(s, 0.99),
		rps: float64(len(s)) / b.elapsed.Seconds(),
	}
}

// percentile is the nearest-rank percentile of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// series is what several rounds of one target measured: one stat per round.
type series []stat

func (s series) med(f func(stat) float64) float64 {
	xs := make([]float64, len(s))
	for i, st := range s {
		xs[i] = f(st)
	}
	return median(xs)
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

func p50us(s stat) float64 { return us(s.p50) }
func p90us(s stat) float64 { return us(s.p90) }
func p99us(s stat) float64 { return us(s.p99) }
func rps(s stat) float64   { return s.rps }

// paired is a per-round comparison of two series measured in the same
// rounds: its median and its range over the rounds.
type paired struct{ med, lo, hi float64 }

func pair(a, b series, f func(x, y stat) float64) paired {
	n := min(len(a), len(b))
	xs := make([]float64, n)
	for i := range n {
		xs[i] = f(a[i], b[i])
	}
	if n == 0 {
		return paired{math.NaN(), math.NaN(), math.NaN()}
	}
	return paired{med: median(xs), lo: slices.Min(xs), hi: slices.Max(xs)}
}

func ratioP50(x, y stat) float64 { return float64(x.p50) / float64(y.p50) }
func ratioP99(x, y stat) float64 { return float64(x.p99) / float64(y.p99) }
func ratioRPS(x, y stat) float64 { return x.rps / y.rps }
func diffP50(x, y stat) float64  { return us(x.p50 - y.p50) }
