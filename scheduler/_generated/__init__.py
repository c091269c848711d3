"""Generated from proto/tinydist/v1/cluster.proto by proto/generate.py; do not edit."""
