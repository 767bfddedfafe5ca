"""Speculative decoding: draft proposers (n-gram prompt lookup, the model's MTP head) and their contract."""
