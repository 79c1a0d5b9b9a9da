"""Small pieces with no kvroute imports, shared by the router's packages: a bounded LRU and a
periodic task."""
