from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.accounts.selectors import project_list
from webapp.accounts.services import project_create


class ProjectOutput(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    slug = serializers.CharField()
    created_at = serializers.DateTimeField()


class ProjectListApi(APIView):
    def get(self, request):
        return Response(ProjectOutput(project_list(user=request.user), many=True).data)


class ProjectCreateApi(APIView):
    class InputSerializer(serializers.Serializer):
        name = serializers.CharField(max_length=100)
        slug = serializers.SlugField(max_length=100, required=False)

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project = project_create(user=request.user, **data.validated_data)
        return Response(ProjectOutput(project).data, status=201)
