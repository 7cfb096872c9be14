"""Run reports: learning curves and a self-contained HTML page."""

from turnrl.report.curves import read_metrics, write_curves, write_report

__all__ = ["read_metrics", "write_curves", "write_report"]
