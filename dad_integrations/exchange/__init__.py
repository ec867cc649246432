"""The exchange: the ordered per-step exchanger (`exchanger`) and its route policy (`policy`), the
step window and worker, the first-step checks, and the sharded exchanger FSDP2 and ZeRO share
(`sharded`)."""
