"""The frontend: the public ChatService. Stateless: sessions, affinity and turn logs live in the store."""
