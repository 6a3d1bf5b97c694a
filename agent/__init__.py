"""The node agent: collectors, the report buffer and the uplink to the coordinator."""
