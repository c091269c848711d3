"""Observability: traces of device work (Chrome Trace Event Format), terminal summaries and Gantt
charts of them, and Prometheus metrics. See docs/observability.md.

    with tinydist.trace("run.json"):      # or TINYDIST_TRACE=run.json, or `tinydist profile script.py`
        ...
"""

from tinydist.observability.tracing import Tracer, active_tracer, span, start, start_from_environment, stop, trace

start_from_environment()  # TINYDIST_TRACE=path.json traces the whole program

__all__ = ["Tracer", "active_tracer", "span", "start", "stop", "trace"]
