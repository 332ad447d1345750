"""What every web app shares and that depends on none of them: the domain error services raise
and query-parameter parsing. (The API layer, ``webapp.api``, sits above all apps.)"""
