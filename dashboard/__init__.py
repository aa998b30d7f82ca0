"""The Streamlit dashboard (`streamlit run dashboard/app.py`): a package like the others, installed with
the project, so that the page's imports resolve however streamlit is started (the `streamlit` console
script puts only the script's own folder on sys.path, not the working directory)."""
