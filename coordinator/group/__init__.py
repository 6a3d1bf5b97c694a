"""Several coordinators as one group: membership in etcd under leases, and who owns which job and node."""
