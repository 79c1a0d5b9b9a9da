"""The decision: from token ids to a ranked list of replicas. The index match per tier, burst
hints, approximate history, placement of new prefixes, the queue model, the policies and
their cost estimates, the decision log and the predicted-vs-delivered accuracy. It reads the
fleet and the index; it sends nothing."""
