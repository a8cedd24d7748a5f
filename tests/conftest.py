"""Shared fixtures of the bngrad test suite (filled in below); puts tests/ on sys.path."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
