"""What runs each step and what a step's tokens do to their requests: the scheduler, the stall
bound, requests and their detokenizers, and the KV block manager with the prefix cache."""
