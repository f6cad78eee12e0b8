{{/* Names and labels. */}}
{{- define "nebula.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nebula.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "nebula.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: api
{{- end -}}

{{- define "nebula.webuiSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: webui
{{- end -}}

{{- define "nebula.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "nebula.webuiImage" -}}
{{- printf "%s:%s" .Values.webui.image.repository (default .Chart.AppVersion .Values.webui.image.tag) -}}
{{- end -}}

{{- define "nebula.claimName" -}}
{{- if .Values.model.pvc.existingClaim -}}
{{- .Values.model.pvc.existingClaim -}}
{{- else -}}
{{- printf "%s-models" (include "nebula.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The WebUI container, as a sidecar (apiUrl 127.0.0.1) or in its own Deployment (apiUrl the Service). */}}
{{- define "nebula.webuiContainer" -}}
- name: webui
  image: {{ include "nebula.webuiImage" .root }}
  imagePullPolicy: {{ .root.Values.webui.image.pullPolicy }}
  env:
    - name: NEBULA_API_URL
      value: {{ .apiUrl | quote }}
    - name: WEBUI_PORT
      value: {{ .root.Values.webui.port | quote }}
    {{- if .root.Values.apiKeySecret }}
    - name: NEBULA_API_KEY
      valueFrom:
        secretKeyRef:
          name: {{ .root.Values.apiKeySecret }}
          key: api-key
    {{- end }}
  ports:
    - name: webui
      containerPort: {{ .root.Values.webui.port }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /webui-health
      port: webui
    periodSeconds: 10
  livenessProbe:
    httpGet:
      path: /webui-health
      port: webui
    periodSeconds: 20
  securityContext:
    runAsNonRoot: true
    runAsUser: 10001
    allowPrivilegeEscalation: false
    capabilities:
      drop: [ALL]
  resources:
    {{- toYaml .root.Values.webui.resources | nindent 4 }}
{{- end -}}

{{/* The endpoint picker of the InferencePool (inferenceGateway.endpointPicker). */}}
{{- define "nebula.eppName" -}}
{{- default (printf "%s-epp" (include "nebula.fullname" . | trunc 59 | trimSuffix "-")) .Values.inferenceGateway.endpointPicker.name -}}
{{- end -}}

{{- define "nebula.eppSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}
