from django.urls import path

from webapp.dashboard import views

urlpatterns = [
    path("", views.run_list_view, name="run-list"),
    path("runs/new/", views.run_new, name="run-new"),
    path("runs/<id:run_id>/", views.run_detail, name="run-detail"),
    path("runs/<id:run_id>/cancel/", views.run_cancel_view, name="run-cancel"),
    path("runs/<id:run_id>/resume/", views.run_resume_view, name="run-resume"),
    path("runs/<id:run_id>/export/", views.run_export_view, name="run-export"),
    path("runs/<id:run_id>/sync-sweep/", views.run_sync_sweep_view, name="run-sync-sweep"),
    path("sweeps/", views.sweep_list_view, name="sweep-list"),
    path("sweeps/<id:sweep_id>/", views.sweep_detail, name="sweep-detail"),
    path("compare/", views.run_compare, name="run-compare"),
    path("datasets/", views.dataset_list_view, name="dataset-list"),
    path("datasets/<id:dataset_id>/", views.dataset_detail, name="dataset-detail"),
    path("datasets/<id:dataset_id>/eval-set/", views.dataset_version_eval_set_view,
         name="dataset-eval-set"),
    path("rewards/", views.reward_list_view, name="reward-list"),
    path("rewards/<id:reward_id>/", views.reward_detail, name="reward-detail"),
]
