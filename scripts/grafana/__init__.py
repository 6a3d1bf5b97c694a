"""clusterwatch's Grafana dashboards as code; ``scripts/gen_dashboards.py`` writes them to ``dashboards/``."""
