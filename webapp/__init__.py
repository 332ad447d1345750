"""Oolong's web app: datasets, reward functions, runs, the experiment tracker, dashboards, API."""
