"""The version every Tandem process reports (health, discovery records, /metrics)."""

VERSION = "0.1.0"
