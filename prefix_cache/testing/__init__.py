"""Test and benchmark tooling (offline tokenizers of many model families, the boundary
benchmark behind ``prefix-cache bench``); nothing the sidecar or the library imports at run
time."""
