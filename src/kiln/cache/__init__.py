"""A content-addressed cache of step outputs in an OCI registry (any registry that speaks the OCI distribution
API: distribution/registry, Harbor, NGC private registry, ECR, GCR/Artifact Registry, ACR, Artifactory, GHCR).

Generic and recipe-agnostic: a registry client (:mod:`.registry`) with the registry's usual credentials
(:mod:`.credentials`), and the mapping between a step's output directory and one OCI artifact
(:mod:`.artifact`). The pipeline decides what to look up and push (:mod:`kiln.pipeline.remote`).
"""
