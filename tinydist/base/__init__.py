"""Base: what every layer uses — the exception tree (errors), every setting (config), structured
logs (logs) and graph walks of any depth (walk). Imports nothing else of tinydist."""
