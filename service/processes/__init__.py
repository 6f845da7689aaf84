"""The operating system's side: Envoy's process, children that die with the server, CPUs,
malloc, build info."""
