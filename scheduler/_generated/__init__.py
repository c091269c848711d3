"""Generated from proto/tinydist/v1/cluster.proto by scheduler/generate.py; do not edit."""
