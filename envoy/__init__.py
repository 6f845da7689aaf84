"""Envoy configuration for textgen's HTTP faces: the transcoder's descriptor set
(`textgen.binpb`, generated from api/) and what renders the config."""
