"""What test modules share: cluster fixtures, chaos faults and load, references (Hugging Face, OpenAI's
schemas), the transfer scenarios' parts. Test modules import from here; no test module imports another."""
