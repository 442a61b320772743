package main

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"
)

// Every benchmark of internal/engine has a line in results.md's engine
// table saying what it does.
func TestEngineBenchNotes(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("..", "..", "internal", "engine", "*_test.go"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no engine test files: %v", err)
	}
	bench := regexp.MustCompile(`(?m)^func (Benchmark\w+)\(\w+ \*testing\.B\)`)
	found := 0
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range bench.FindAllSubmatch(src, -1) {
			found++
			if engineBenchNotes[string(m[1])] == "" {
				t.Errorf("%s (%s) has no note in engineBenchNotes", m[1], filepath.Base(f))
			}
		}
	}
	if found == 0 {
		t.Fatal("found no engine benchmarks")
	}
}
