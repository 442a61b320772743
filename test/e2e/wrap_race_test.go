//go:build race

package e2e_test

// raceEnabled builds the wrap tests' binaries with -race too.
const raceEnabled = true
